#!/usr/bin/env python3
"""Writes a random-weight checkpoint in the Hugging Face layout, for benchmarks
and numerics checks on the device (torch + safetensors; the GPU makes it fast).

  qwen3-8b    Qwen3ForCausalLM of Qwen3-8B's shape: hidden 4096, 36 layers,
              32/8 heads of 128, intermediate 12288, vocab 151936, untied lm_head
  dflash-8b   a DFlash draft of z-lab/Qwen3-8B-DFlash-b16's shape: 5 layers of the
              same dims, block 16, target_layer_ids [1, 9, 17, 25, 33], mask 151669
  qwen3-30b-a3b  Qwen3MoeForCausalLM of Qwen3-30B-A3B's shape: hidden 2048, 48 layers,
              32/4 heads of 128, 128 experts of 768 (top 8, renormalized), vocab 151936,
              untied lm_head; per-expert tensors as on the hub (about 61 GB)
  dflash-30b-a3b  a dense DFlash draft for it, laid out as the 8B one: 5 layers of hidden 2048,
              32/4 heads of 128, intermediate 6144, block 16, target_layer_ids [1, 12, 23, 34, 45]
              (the default rule for 48 target layers), mask 151669

  qwen3_5-27b  Qwen3_5ForCausalLM of Qwen3.5-27B's shape: hidden 5120, 64 layers (every fourth
              gated full attention: 24/4 heads of 256, partial rotary 0.25; the others Gated
              DeltaNet: 16 key / 48 value heads of 128, convolution 4), intermediate 17408, vocab
              248320, untied lm_head (about 54 GB)
  dflash-qwen3_5-27b  a DFlash draft for it laid out as the 8B one: 5 layers of hidden 5120, 32/8
              heads of 128, intermediate 17408, block 16, target_layer_ids [1, 16, 31, 46, 61] (the
              default rule for 64 target layers), mask 248077

Usage: make_random_checkpoint.py SHAPE OUT_DIR [--layers N] [--target-layers N] [--seed S]
(--layers overrides the layer count, e.g. a few real-size layers for a logits check; --target-layers
makes a draft for a target of that many layers, its captured layers by the default rule: e.g. the
draft of a 12-layer 30B-A3B-shaped target, a quick stand-in for the 48 layers in kernel A/B runs.)
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

SHAPES = {
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ff=12288, vocab=151936),
    "dflash-8b": dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, ff=12288, vocab=151936,
                      target_layers=36, layer_ids=[1, 9, 17, 25, 33], mask=151669, block=16),
    "qwen3-30b-a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ff=6144, vocab=151936,
                          experts=128, top_k=8, moe_ff=768),
    "dflash-30b-a3b": dict(hidden=2048, layers=5, heads=32, kv_heads=4, head_dim=128, ff=6144, vocab=151936,
                           target_layers=48, layer_ids=[1, 12, 23, 34, 45], mask=151669, block=16),
    "qwen3_5-27b": dict(hidden=5120, layers=64, heads=24, kv_heads=4, head_dim=256, ff=17408, vocab=248320,
                        linear=dict(k_heads=16, v_heads=48, k_dim=128, v_dim=128, kernel=4), interval=4),
    "dflash-qwen3_5-27b": dict(hidden=5120, layers=5, heads=32, kv_heads=8, head_dim=128, ff=17408, vocab=248320,
                               target_layers=64, layer_ids=[1, 16, 31, 46, 61], mask=248077, block=16),
}
TARGETS = ("qwen3-8b", "qwen3-30b-a3b", "qwen3_5-27b")
SHARD_BYTES = 4 << 30


def config_for(name, s):
    base = {
        "hidden_size": s["hidden"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"], "intermediate_size": s["ff"],
        "vocab_size": s["vocab"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "max_position_embeddings": 40960, "attention_bias": False, "tie_word_embeddings": False,
        "model_type": "qwen3", "torch_dtype": "bfloat16",
    }
    if name in TARGETS:
        base.update({"architectures": ["Qwen3ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
                     "use_sliding_window": False, "sliding_window": None})
        if "linear" in s:
            lin = s["linear"]
            base.update({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                         "bos_token_id": None, "eos_token_id": 248044, "full_attention_interval": s["interval"],
                         "linear_num_key_heads": lin["k_heads"], "linear_num_value_heads": lin["v_heads"],
                         "linear_key_head_dim": lin["k_dim"], "linear_value_head_dim": lin["v_dim"],
                         "linear_conv_kernel_dim": lin["kernel"], "max_position_embeddings": 262144,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25}})
            base.pop("rope_theta")
        if "experts" in s:
            base.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                         "num_experts": s["experts"], "num_experts_per_tok": s["top_k"],
                         "moe_intermediate_size": s["moe_ff"], "norm_topk_prob": True, "decoder_sparse_step": 1,
                         "mlp_only_layers": []})
    else:
        base.update({"architectures": ["DFlashDraftModel"], "block_size": s["block"],
                     "num_target_layers": s["target_layers"],
                     "dflash_config": {"mask_token_id": s["mask"], "target_layer_ids": s["layer_ids"]}})
    return base


def tensors(name, s, gen, device):
    h, q, kv, ff = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["ff"]

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()

    def norm(n):
        return (1.0 + torch.randn(n, generator=gen, device=device) * 0.1).to(torch.bfloat16).cpu()

    prefix = "model." if name in TARGETS else ""
    if name in TARGETS:
        yield "model.embed_tokens.weight", rnd(s["vocab"], h, std=1.0)
    else:
        yield "fc.weight", rnd(h, len(s["layer_ids"]) * h)
        yield "hidden_norm.weight", norm(h)
    lin = s.get("linear")

    def zero_centred(n):  # Qwen3.5's norms scale by 1 + weight
        return (torch.randn(n, generator=gen, device=device) * 0.1).to(torch.bfloat16).cpu()

    for i in range(s["layers"]):
        p = f"{prefix}layers.{i}."
        if lin:
            yield p + "input_layernorm.weight", zero_centred(h)
            yield p + "post_attention_layernorm.weight", zero_centred(h)
            if (i + 1) % s["interval"]:
                kd, vd = lin["k_heads"] * lin["k_dim"], lin["v_heads"] * lin["v_dim"]
                a = p + "linear_attn."
                yield a + "in_proj_qkv.weight", rnd(2 * kd + vd, h)
                yield a + "in_proj_z.weight", rnd(vd, h)
                yield a + "in_proj_b.weight", rnd(lin["v_heads"], h)
                yield a + "in_proj_a.weight", rnd(lin["v_heads"], h)
                yield a + "conv1d.weight", rnd(2 * kd + vd, 1, lin["kernel"], std=0.3)
                yield a + "A_log", rnd(lin["v_heads"], std=0.5)
                yield a + "dt_bias", rnd(lin["v_heads"], std=0.5)
                yield a + "norm.weight", norm(lin["v_dim"])
                yield a + "out_proj.weight", rnd(h, vd)
            else:
                yield p + "self_attn.q_proj.weight", rnd(2 * q, h)
                yield p + "self_attn.k_proj.weight", rnd(kv, h)
                yield p + "self_attn.v_proj.weight", rnd(kv, h)
                yield p + "self_attn.o_proj.weight", rnd(h, q)
                yield p + "self_attn.q_norm.weight", zero_centred(s["head_dim"])
                yield p + "self_attn.k_norm.weight", zero_centred(s["head_dim"])
            yield p + "mlp.gate_proj.weight", rnd(ff, h)
            yield p + "mlp.up_proj.weight", rnd(ff, h)
            yield p + "mlp.down_proj.weight", rnd(h, ff)
            continue
        yield p + "input_layernorm.weight", norm(h)
        yield p + "self_attn.q_proj.weight", rnd(q, h)
        yield p + "self_attn.k_proj.weight", rnd(kv, h)
        yield p + "self_attn.v_proj.weight", rnd(kv, h)
        yield p + "self_attn.o_proj.weight", rnd(h, q)
        yield p + "self_attn.q_norm.weight", norm(s["head_dim"])
        yield p + "self_attn.k_norm.weight", norm(s["head_dim"])
        yield p + "post_attention_layernorm.weight", norm(h)
        if "experts" in s:
            yield p + "mlp.gate.weight", rnd(s["experts"], h)
            for e in range(s["experts"]):
                yield p + f"mlp.experts.{e}.gate_proj.weight", rnd(s["moe_ff"], h)
                yield p + f"mlp.experts.{e}.up_proj.weight", rnd(s["moe_ff"], h)
                yield p + f"mlp.experts.{e}.down_proj.weight", rnd(h, s["moe_ff"])
            continue
        yield p + "mlp.gate_proj.weight", rnd(ff, h)
        yield p + "mlp.up_proj.weight", rnd(ff, h)
        yield p + "mlp.down_proj.weight", rnd(h, ff)
    yield prefix + "norm.weight", zero_centred(h) if lin else norm(h)
    if name in TARGETS:
        yield "lm_head.weight", rnd(s["vocab"], h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--target-layers", type=int, help="drafts: the target's layer count")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    s = dict(SHAPES[a.shape])
    if a.layers:
        s["layers"] = a.layers
        if "layer_ids" in s:
            s["layer_ids"] = [i for i in s["layer_ids"] if i < s["target_layers"]]
    if a.target_layers:
        if "layer_ids" not in s:
            ap.error(f"--target-layers is for drafts, not {a.shape}")
        if a.target_layers < 5:
            ap.error("--target-layers must be at least 5")
        # The engine's default rule (default_target_layer_ids): one layer a draft layer, evenly
        # from layer 1 to layer N - 3, rounded half to even as Python's round() does.
        n, k = a.target_layers, s["layers"]
        s["target_layers"] = n
        s["layer_ids"] = [round(1 + i * (n - 4) / (k - 1)) for i in range(k)] if k > 1 else [n // 2]
    os.makedirs(a.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(a.seed)
    # Shards are written as they fill (the 30B-A3B shape is about 61 GB: never all in memory).
    weight_map, total, n_shards = {}, 0, 0
    current, size = {}, 0

    def flush():
        nonlocal n_shards, current, size
        n_shards += 1
        fname = f"model-{n_shards:05d}.safetensors"
        save_file(current, os.path.join(a.out, fname), metadata={"format": "pt"})
        for k in current:
            weight_map[k] = fname
        current, size = {}, 0

    for key, t in tensors(a.shape, s, gen, device):
        if current and size + t.numel() * 2 > SHARD_BYTES:
            flush()
        current[key] = t
        size += t.numel() * 2
        total += t.numel() * 2
    flush()
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config_for(a.shape, s), f, indent=2)
    print(f"{a.out}: {a.shape}, {s['layers']} layers, {total / 1e9:.2f} GB in {n_shards} file(s)")


if __name__ == "__main__":
    main()
