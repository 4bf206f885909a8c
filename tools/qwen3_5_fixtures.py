"""The Qwen3.5 hybrid fixtures (Gated DeltaNet + gated attention), written by transformers'
own Qwen3_5 / Qwen3_5Moe classes; called by make_fixtures.py (--only qwen3_5):

  targets/qwen3_5_tied            dense, float32, tied embeddings, key/value head ratio 2
  targets/qwen3_5_moe_untied_bf16 MoE with a shared expert, bfloat16, untied
  targets/qwen3_5_vl_tied         qwen3_5_tied inside Qwen3_5ForConditionalGeneration (a tiny
                                  vision tower; language weights under model.language_model.)
  targets/trained_qwen3_5 + drafts/trained_qwen3_5_b16   a trained pair (real acceptance)
  expected/<name>.*               as the other targets, plus 200 steps of incremental decoding

The reference math is float64. transformers computes the delta rule in float32 whatever the
model's dtype, so the fixtures swap in the float64 recurrence below (checked against
transformers' own functions before use).
"""
import os
import shutil

import torch
import transformers
import transformers.models.qwen3_5.modeling_qwen3_5 as q35
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as q35moe
from transformers import (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                          Qwen3_5TextConfig)
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

NAMES = ["qwen3_5_tied", "qwen3_5_moe_untied_bf16", "qwen3_5_vl_tied"]
TRAINED = "trained_qwen3_5"
INCREMENTAL_STEPS = 200


def recurrent_delta_rule_f64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, chunk_size=None, **kwargs):
    """The gated delta rule token by token in float64 (same arguments and results as
    transformers' torch_recurrent_gated_delta_rule / torch_chunk_gated_delta_rule)."""
    dtype = query.dtype
    q, k, v, b, gg = [x.transpose(1, 2).to(torch.float64) for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / (q.shape[-1] ** 0.5)
    bsz, heads, seq, dk = k.shape
    dv = v.shape[-1]
    s = (torch.zeros(bsz, heads, dk, dv, dtype=torch.float64, device=v.device) if initial_state is None
         else initial_state.to(torch.float64))
    out = torch.zeros(bsz, heads, seq, dv, dtype=torch.float64, device=v.device)
    for t in range(seq):
        s = s * gg[:, :, t].exp()[..., None, None]
        kv_mem = (s * k[:, :, t, :, None]).sum(-2)
        delta = (v[:, :, t] - kv_mem) * b[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (s * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).contiguous().to(dtype), (s if output_final_state else None)


ORIGINAL = {m: (m.torch_recurrent_gated_delta_rule, m.torch_chunk_gated_delta_rule) for m in (q35, q35moe)}


def use_f64_delta_rule(on):
    """Swaps the float64 recurrence in for transformers' delta rule (on) or puts theirs back
    (training uses their faster chunked form)."""
    for m, (recurrent, chunk) in ORIGINAL.items():
        m.torch_recurrent_gated_delta_rule = recurrent_delta_rule_f64 if on else recurrent
        m.torch_chunk_gated_delta_rule = recurrent_delta_rule_f64 if on else chunk


def check_f64_delta_rule():
    """The float64 recurrence gives transformers' results (both of its forms, in every module
    that ORIGINAL lists)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 9, 2, 8), torch.randn(1, 9, 2, 8)
    v, g, b = torch.randn(1, 9, 2, 4), -torch.rand(1, 9, 2), torch.rand(1, 9, 2)
    s0 = torch.randn(1, 2, 8, 4)
    ours, s_ours = recurrent_delta_rule_f64(q, k, v, g, b, s0, True, True)
    for fn in [fn for forms in ORIGINAL.values() for fn in forms]:
        theirs, s_theirs = fn(q, k, v, g=g, beta=b, initial_state=s0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        assert torch.allclose(ours, theirs, atol=1e-5) and torch.allclose(s_ours.float(), s_theirs, atol=1e-5), fn


def hybrid_config(cls, mf, **kw):
    rope = {"rope_type": "default", "rope_theta": kw.pop("rope_theta"),
            "partial_rotary_factor": kw.pop("partial_rotary_factor")}
    return cls(vocab_size=mf.VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=mf.EOS_ID,
               hidden_act="silu", rope_parameters=rope, **kw)


def randomize(model, seed):
    """make_fixtures.randomize, but the zero-centred norms (weight w scales by 1 + w) get small
    weights and the gated norm of the linear attention (scales by w) weights around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5))


DENSE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                                       "full_attention"],
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, rope_theta=10000.0, partial_rotary_factor=0.25, rms_norm_eps=1e-6)
MOE = dict(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=24,
           layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
           linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=12, linear_value_head_dim=16,
           linear_conv_kernel_dim=3, rope_theta=1000000.0, partial_rotary_factor=0.5, rms_norm_eps=1e-6,
           num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)


def incremental_reference(model, prompt, steps):
    """Greedy decoding with transformers' cache (prefill, then one token a step): tokens and the
    logits of every step [steps, V]."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([l[0] for l in out.logits])


def add_incremental(mf, out, name, rng, device):
    model = mf.reload_target(os.path.join(out, "targets", name), device)
    prompt = [rng.randrange(3, mf.MASK_ID) for _ in range(11)]
    tokens, logits = incremental_reference(model, prompt, INCREMENTAL_STEPS)
    from safetensors.torch import load_file, save_file
    import json
    path = os.path.join(out, "expected", name)
    tensors = load_file(path + ".safetensors")
    tensors["incremental_logits"] = logits.to(torch.float32).cpu().contiguous()
    save_file(tensors, path + ".safetensors")
    meta = json.load(open(path + ".json"))
    meta.update(incremental_prompt=prompt, incremental_tokens=tokens)
    json.dump(meta, open(path + ".json", "w"), indent=1)
    print(f"{name}: {INCREMENTAL_STEPS} incremental steps written", flush=True)


def vl_checkpoint(mf, out, dense_cfg, text_model):
    """The dense target inside Qwen3_5ForConditionalGeneration, as the hub's Qwen3.5 checkpoints
    are: transformers writes the language model under model.language_model. and a vision tower."""
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=dense_cfg.hidden_size, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=dense_cfg.to_dict(), vision_config=vision, tie_word_embeddings=True)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    model.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
    path = os.path.join(out, "targets", "qwen3_5_vl_tied")
    model.save_pretrained(path)
    from safetensors import safe_open
    keys = []
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                keys += list(st.keys())
    print("qwen3_5_vl_tied keys:", sorted(k for k in keys if "layers.0." in k or "layers" not in k), flush=True)
    print("qwen3_5_vl_tied config:", open(os.path.join(path, "config.json")).read(), flush=True)


def trained_pair(mf, out, device, args):
    for p in (os.path.join(out, "targets", TRAINED), os.path.join(out, "drafts", TRAINED + "_b16")):
        shutil.rmtree(p, ignore_errors=True)
    import random
    reload = mf.reload_target

    def reload_f64(path, device):  # training runs transformers' delta rule, the references ours
        use_f64_delta_rule(True)
        return reload(path, device)
    mf.reload_target = reload_f64
    use_f64_delta_rule(False)
    mf.good_pair(out, device, random.Random(4324), args.target_steps, args.draft_steps, kind="qwen3_5", name=TRAINED,
                 num_hidden_layers=4, intermediate_size=256, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                 layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                 partial_rotary_factor=0.25)
    mf.reload_target = reload


def write(mf, out, device, rng, args, trained_only=False):
    check_f64_delta_rule()
    use_f64_delta_rule(True)
    mf.MODEL_CLASSES["qwen3_5"] = (Qwen3_5TextConfig, Qwen3_5ForCausalLM)
    mf.MODEL_CLASSES["qwen3_5_moe"] = (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)
    if trained_only:
        trained_pair(mf, out, device, args)
        return
    for sub in ("targets", "drafts", "expected"):
        for n in NAMES + [n + "_l1" for n in NAMES]:
            for path in (os.path.join(out, sub, n), os.path.join(out, sub, n + ".json"),
                         os.path.join(out, sub, n + ".safetensors")):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
    torch.manual_seed(31)
    dense = Qwen3_5ForCausalLM(hybrid_config(Qwen3_5TextConfig, mf, tie_word_embeddings=True, **DENSE))
    randomize(dense, 31)
    dense.save_pretrained(os.path.join(out, "targets", "qwen3_5_tied"))
    torch.manual_seed(32)
    moe = mf.eager_experts(Qwen3_5MoeForCausalLM(hybrid_config(Qwen3_5MoeTextConfig, mf, tie_word_embeddings=False,
                                                               **MOE)))
    randomize(moe, 32)
    moe.to(torch.bfloat16).save_pretrained(os.path.join(out, "targets", "qwen3_5_moe_untied_bf16"))
    vl_checkpoint(mf, out, dense.config, dense)
    for name in ("qwen3_5_tied", "qwen3_5_moe_untied_bf16"):
        print(name, open(os.path.join(out, "targets", name, "config.json")).read(), flush=True)
        mf.check_expert_layout(os.path.join(out, "targets", name))
    drafts = [("qwen3_5_tied", "qwen3_5_tied_l1", torch.float32),
              ("qwen3_5_moe_untied_bf16", "qwen3_5_moe_untied_bf16_l1", torch.bfloat16)]
    for i, (tname, dname, dtype) in enumerate(drafts):
        tcfg = (dense if i == 0 else moe).config
        torch.manual_seed(300 + i)
        d = mf.ref.DFlashDraft(mf.draft_config(tcfg, 1, 16))
        mf.randomize(d, 300 + i)
        mf.ref.save_draft(d, os.path.join(out, "drafts", dname), dtype)
        mf.reference_case(out, tname, os.path.join(out, "targets", tname), os.path.join(out, "drafts", dname),
                          device, rng)
        add_incremental(mf, out, tname, rng, device)
    if not args.skip_trained:
        trained_pair(mf, out, device, args)
    print(f"transformers {transformers.__version__}: Qwen3.5 fixtures written", flush=True)
