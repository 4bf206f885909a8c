"""Writes the test fixtures under tests/fixtures/ (run on a machine with
torch + transformers; a GPU makes the trained pair take seconds):

  targets/<name>/   tiny random HF checkpoints written by save_pretrained
  drafts/<name>/    DFlash drafts in the z-lab layout
  expected/<name>.safetensors + .json   reference outputs (float64 math)

    python3 tools/make_fixtures.py --out tests/fixtures
    python3 tools/make_fixtures.py --out tests/fixtures --only moe   # the Qwen3-MoE fixtures alone
"""
import argparse
import inspect
import json
import math
import os
import random
import shutil
import sys
import time

import torch
import transformers
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

import qwen3_5_fixtures  # noqa: E402  (the Qwen3.5 hybrid fixtures: --only qwen3_5)
import qwen3_next_fixtures  # noqa: E402  (the Qwen3-Next fixture: --only qwen3_next)

ME = sys.modules[__name__]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_reference as ref  # noqa: E402

VOCAB = 256
MASK_ID = 255
EOS_ID = 0          # generation stops on it; the synthetic data never contains it


def rope_kwargs(config_cls, theta, scaling=None):
    """transformers 5 takes rope_parameters; 4.x takes rope_theta/rope_scaling."""
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    return {"rope_theta": theta, "rope_scaling": scaling}


def randomize(model, seed):
    """Weights large enough that every part of the forward matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


MODEL_CLASSES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                 "llama": (LlamaConfig, LlamaForCausalLM)}


def eager_experts(model):
    """The experts' plain per-expert loop (grouped kernels may not take float64)."""
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    return model


def make_target(kind, seed, **kw):
    cls_cfg, cls_model = MODEL_CLASSES[kind]
    scaling = kw.pop("rope_scaling", None)
    if "partial_rotary_factor" in kw:  # Qwen3.5: a rope parameter
        scaling = dict(scaling or {}, partial_rotary_factor=kw.pop("partial_rotary_factor"))
    rope = rope_kwargs(cls_cfg, kw.pop("rope_theta"), scaling)
    cfg = cls_cfg(vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=EOS_ID,
                  hidden_act="silu", **rope, **kw)
    torch.manual_seed(seed)
    model = eager_experts(cls_model(cfg))
    randomize(model, seed)
    return model.eval()


def draft_config(target_cfg, n_layers, block_size, **extra):
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": target_cfg.num_hidden_layers,
        "dflash_config": {"mask_token_id": MASK_ID},
        "hidden_size": target_cfg.hidden_size,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    layer_ids = extra.pop("target_layer_ids", None)
    if layer_ids is not None:
        cfg["dflash_config"]["target_layer_ids"] = layer_ids
    cfg.update(extra)
    return cfg


def reload_target(path, device):
    model = eager_experts(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    return model.to(device=device, dtype=torch.float64).eval()


def check_expert_layout(path):
    """The per-expert tensor names the hub's Qwen3-MoE checkpoints use (dflash also reads the
    stacked form); reported so that the fixtures record which one transformers wrote."""
    names = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(os.path.join(path, f), "pt") as st:
                names.update(st.keys())
    per_expert = any(".mlp.experts.0.gate_proj.weight" in n for n in names)
    stacked = any(n.endswith(".mlp.experts.gate_up_proj") for n in names)
    print(f"{path}: experts saved {'per expert' if per_expert else 'stacked' if stacked else 'in an unknown layout'}",
          flush=True)


def save_expected(out, name, tensors, meta):
    os.makedirs(os.path.join(out, "expected"), exist_ok=True)
    save_file({k: v.detach().to(torch.float32).contiguous().cpu() for k, v in tensors.items()},
              os.path.join(out, "expected", name + ".safetensors"))
    with open(os.path.join(out, "expected", name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)


def random_prompts(rng, n, lo, hi):
    return [[rng.randrange(3, MASK_ID) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def reference_case(out, name, target_dir, draft_dir, device, rng, n_prompts=20, max_new=24):
    """Target logits + every layer output on one input, draft block logits,
    plain and DFlash greedy tokens on random prompts."""
    model = reload_target(target_dir, device)
    draft = ref.load_draft(draft_dir).to(device)
    n_layers = model.config.num_hidden_layers
    ids = [rng.randrange(1, VOCAB) for _ in range(13)]
    logits, outs = ref.layer_outputs(model, ids, list(range(n_layers)))
    tensors = {"logits": logits}
    for j, o in enumerate(outs):
        tensors[f"layer_out.{j}"] = o
    # HF's hidden_states[j+1] is layer j's output for every layer but the last (normed there).
    with torch.no_grad():
        hs = model(torch.tensor([ids], device=device), output_hidden_states=True).hidden_states
    for j in range(n_layers - 1):
        assert torch.allclose(hs[j + 1][0], outs[j], rtol=0, atol=1e-12), f"hidden_states[{j + 1}] differs from layer {j} output"

    feats = torch.cat([outs[j] for j in draft.layer_ids], dim=-1)
    pending = int(logits[-1].argmax())
    for B in (4, 16):
        with torch.no_grad():
            tensors[f"draft_logits.b{B}"] = ref.draft_block_logits(model, draft, feats, len(ids), pending, B, MASK_ID)

    prompts = random_prompts(rng, n_prompts, 1, 12)
    plain = [ref.plain_greedy(model, p, max_new, [EOS_ID]) for p in prompts]
    spec = [ref.dflash_greedy(model, draft, p, max_new, [EOS_ID]) for p in prompts]
    for p, a, (b, _) in zip(prompts, plain, spec):
        assert a == b, f"{name}: reference DFlash output differs from plain greedy for prompt {p}"
    meta = {"target": os.path.relpath(target_dir, out), "draft": os.path.relpath(draft_dir, out),
            "input_ids": ids, "pending": pending, "max_new_tokens": max_new, "eos_ids": [EOS_ID],
            "prompts": prompts, "greedy": plain,
            "dflash_acceptance": [acc for _, acc in spec]}
    save_expected(out, name, tensors, meta)
    print(f"{name}: reference written ({len(prompts)} prompts)", flush=True)


# ----------------------------------------------------------------------------
# The "good" pair: a target trained on a predictable synthetic language and a
# draft trained on it with the DFlash recipe, so that drafts are accepted.

def synthetic_sequence(rng, length):
    """Repeated short patterns and counting runs: learnable, continuable."""
    seq = []
    while len(seq) < length:
        if rng.random() < 0.7:
            period = rng.randrange(2, 7)
            pattern = [rng.randrange(3, MASK_ID) for _ in range(period)]
            seq += pattern * rng.randrange(3, 7)
        else:
            start, step = rng.randrange(3, MASK_ID), rng.choice([1, 2, 3])
            seq += [3 + (start - 3 + step * i) % (MASK_ID - 3) for i in range(rng.randrange(8, 20))]
    return seq[:length]


def train_target(model, rng, device, steps, seq_len=128, batch=64):
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        x = torch.tensor([synthetic_sequence(rng, seq_len) for _ in range(batch)], device=device)
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"  target step {step} loss {loss.item():.4f}", flush=True)
    return model.eval()


def train_draft(model, draft, rng, device, steps, batch=64, prompt_len=32, total_len=128, gamma=4.0):
    """docs/algorithm.md section 7: labels are the target's greedy predictions; one random
    anchor per step (shared by the batch); row i weighted by exp(-(i-1)/gamma)."""
    B = draft.cfg["block_size"]
    layer_ids = draft.layer_ids
    draft.to(device).train()
    opt = torch.optim.AdamW(draft.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    weights = torch.exp(-torch.arange(B - 1, device=device, dtype=torch.float32) / gamma)
    embed = model.model.embed_tokens
    data = None
    for step in range(steps):
        if step % 50 == 0:   # fresh target-generated sequences
            prompts = torch.tensor([synthetic_sequence(rng, prompt_len) for _ in range(batch)], device=device)
            with torch.no_grad():
                seqs = model.generate(prompts, max_new_tokens=total_len - prompt_len, do_sample=False,
                                      min_new_tokens=total_len - prompt_len, pad_token_id=EOS_ID)
                out = model(seqs, output_hidden_states=True)
                feats = torch.cat([out.hidden_states[j + 1] for j in layer_ids], dim=-1)
                labels = out.logits.argmax(-1)          # target's prediction for position t+1
            data = (seqs, feats, labels)
        seqs, feats, labels = data
        p = rng.randrange(8, total_len - B)
        block = torch.full((batch, B), MASK_ID, device=device)
        block[:, 0] = seqs[:, p]
        with torch.no_grad():
            emb = embed(block)
        hidden = draft(feats[:, :p], torch.arange(p, device=device), emb, torch.arange(p, p + B, device=device))
        logits = model.lm_head(hidden[:, 1:])
        target = labels[:, p:p + B - 1]                  # row i predicts position p+i
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
        loss = (ce.view(batch, B - 1) * weights).sum() / (weights.sum() * batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            acc = (logits.argmax(-1) == target).float().mean(0)
            print(f"  draft step {step} loss {loss.item():.4f} acc[1..4] {acc[:4].tolist()}", flush=True)
    return draft.eval()


def good_pair(out, device, rng, target_steps, draft_steps, kind="qwen3", name="trained_qwen3", **shape):
    t0 = time.time()
    dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32)
    dims.update(shape)
    model = make_target(kind, 7, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **dims)
    with torch.no_grad():   # back to small init for training
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model = train_target(model, rng, device, target_steps)
    tdir = os.path.join(out, "targets", name)
    model.to(torch.bfloat16).save_pretrained(tdir)
    model = reload_target(tdir, device).float()        # train the draft on the bf16-rounded target
    dcfg = draft_config(model.config, 2, 16, hidden_size=128, intermediate_size=256, head_dim=32)
    torch.manual_seed(11)
    draft = ref.DFlashDraft(dcfg)
    draft = train_draft(model, draft, rng, device, draft_steps)
    ddir = os.path.join(out, "drafts", name + "_b16")
    ref.save_draft(draft, ddir, torch.bfloat16)
    print(f"good pair trained in {time.time() - t0:.1f} s", flush=True)

    model = reload_target(tdir, device)
    draft = ref.load_draft(ddir).to(device)
    prompts = [synthetic_sequence(rng, rng.randrange(12, 40)) for _ in range(20)]
    max_new = 64
    plain = [ref.plain_greedy(model, p, max_new, [EOS_ID]) for p in prompts]
    result = {"target": "targets/" + name, "draft": "drafts/" + name + "_b16",
              "max_new_tokens": max_new, "eos_ids": [EOS_ID], "prompts": prompts, "greedy": plain}
    for B in (4, 8, 16):
        spec = [ref.dflash_greedy(model, draft, p, max_new, [EOS_ID], block_size=B) for p in prompts]
        for p, a, (b, _) in zip(prompts, plain, spec):
            assert a == b, f"trained pair B={B}: reference DFlash output differs from plain greedy"
        acc = [x for _, lens in spec for x in lens]
        tau = sum(acc) / len(acc)
        print(f"trained pair: block {B}: tau {tau:.3f} over {len(acc)} steps", flush=True)
        result[f"dflash_acceptance_b{B}"] = [lens for _, lens in spec]
        result[f"tau_b{B}"] = tau
    save_expected(out, name, {}, result)


MOE_FIXTURES = ["qwen3_moe_tied", "qwen3_moe_untied_bf16", "trained_qwen3_moe"]


def moe_fixtures(out, device, rng, args):
    """Qwen3-MoE targets: float32 with a dense layer among routed ones (mlp_only_layers) and
    renormalized top-k; bf16 with routed layers every second layer (decoder_sparse_step) and raw
    top-k weights; and a trained pair. Their drafts are dense (the z-lab layout)."""
    for sub, names in (("targets", MOE_FIXTURES), ("drafts", ["qwen3_moe_tied_l1", "qwen3_moe_untied_l2",
                                                            "trained_qwen3_moe_b16"]), ("expected", MOE_FIXTURES)):
        for n in names:
            for path in (os.path.join(out, sub, n), os.path.join(out, sub, n + ".json"),
                         os.path.join(out, sub, n + ".safetensors")):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
    t1 = make_target("qwen3_moe", 21, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    t1.save_pretrained(os.path.join(out, "targets", "qwen3_moe_tied"))
    t2 = make_target("qwen3_moe", 22, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=24, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=3,
                     moe_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])
    t2.to(torch.bfloat16).save_pretrained(os.path.join(out, "targets", "qwen3_moe_untied_bf16"))
    for name in ("qwen3_moe_tied", "qwen3_moe_untied_bf16"):
        print(name, open(os.path.join(out, "targets", name, "config.json")).read(), flush=True)
        check_expert_layout(os.path.join(out, "targets", name))
    drafts = [("qwen3_moe_tied", "qwen3_moe_tied_l1", draft_config(t1.config, 1, 16), torch.float32),
              ("qwen3_moe_untied_bf16", "qwen3_moe_untied_l2", draft_config(t2.config, 2, 16), torch.bfloat16)]
    for i, (tname, dname, cfg, dtype) in enumerate(drafts):
        torch.manual_seed(200 + i)
        d = ref.DFlashDraft(cfg)
        randomize(d, 200 + i)
        ref.save_draft(d, os.path.join(out, "drafts", dname), dtype)
        reference_case(out, tname, os.path.join(out, "targets", tname), os.path.join(out, "drafts", dname),
                       device, rng)
    if not args.skip_trained:
        moe_trained_pair(out, device, args)


def moe_trained_pair(out, device, args):
    good_pair(out, device, random.Random(4322), args.target_steps, args.draft_steps, kind="qwen3_moe",
              name="trained_qwen3_moe", num_hidden_layers=4, intermediate_size=256, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument("--draft-steps", type=int, default=1500)
    ap.add_argument("--skip-trained", action="store_true")
    ap.add_argument("--only", choices=["moe", "moe-trained", "qwen3_5", "qwen3_5-trained", "qwen3_next"],
                    help="write only these fixtures (moe-trained: the trained MoE pair), leaving the others as they are")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}", flush=True)
    out = args.out
    if args.only == "moe":
        moe_fixtures(out, device, random.Random(4321), args)
        return
    if args.only == "moe-trained":
        moe_trained_pair(out, device, args)
        return
    if args.only in ("qwen3_5", "qwen3_5-trained"):
        qwen3_5_fixtures.write(ME, out, device, random.Random(4323), args, trained_only=args.only.endswith("trained"))
        return
    if args.only == "qwen3_next":
        qwen3_next_fixtures.write(ME, out, device, random.Random(4325))
        return
    for sub in ("targets", "drafts", "expected"):
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    rng = random.Random(1234)

    # Random targets: Qwen3 GQA tied fp32; Qwen3 MHA untied bf16 with head_dim*heads != hidden;
    # Llama GQA 4:1 with attention bias, llama3 RoPE scaling, sharded.
    t1 = make_target("qwen3", 1, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=True)
    t1.save_pretrained(os.path.join(out, "targets", "qwen3_gqa_tied"))
    t2 = make_target("qwen3", 2, hidden_size=48, intermediate_size=80, num_hidden_layers=5,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=24, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)
    t2.to(torch.bfloat16).save_pretrained(os.path.join(out, "targets", "qwen3_mha_untied_bf16"))
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    t3 = make_target("llama", 3, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=llama3,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True)
    t3.save_pretrained(os.path.join(out, "targets", "llama_gqa4_bias_sharded"), max_shard_size="100KB")
    for name in ("qwen3_gqa_tied", "qwen3_mha_untied_bf16", "llama_gqa4_bias_sharded"):
        print(name, open(os.path.join(out, "targets", name, "config.json")).read(), flush=True)

    drafts = [
        ("qwen3_gqa_tied", "qwen3_gqa_tied_l1", draft_config(t1.config, 1, 16)),
        ("qwen3_mha_untied_bf16", "qwen3_mha_untied_l2", draft_config(t2.config, 2, 16)),
        ("llama_gqa4_bias_sharded", "llama_l2_window",
         draft_config(t3.config, 2, 8, target_layer_ids=[0, 2],
                      layer_types=["sliding_attention", "full_attention"], sliding_window=5)),
    ]
    for i, (tname, dname, cfg) in enumerate(drafts):
        torch.manual_seed(100 + i)
        d = ref.DFlashDraft(cfg)
        randomize(d, 100 + i)
        dtype = torch.bfloat16 if "bf16" in tname else torch.float32
        ref.save_draft(d, os.path.join(out, "drafts", dname), dtype)
        reference_case(out, tname, os.path.join(out, "targets", tname), os.path.join(out, "drafts", dname),
                       device, rng)

    if not args.skip_trained:
        good_pair(out, device, rng, args.target_steps, args.draft_steps)
    moe_fixtures(out, device, random.Random(4321), args)
    qwen3_5_fixtures.write(ME, out, device, random.Random(4323), args)
    qwen3_next_fixtures.write(ME, out, device, random.Random(4325))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    print(f"fixtures: {total / 1e6:.2f} MB under {out}", flush=True)


if __name__ == "__main__":
    main()
