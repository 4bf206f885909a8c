#!/usr/bin/env python3
"""Step 4: train the DFlash draft for the pretrained target (docs/algorithm.md section 7).

Data are the target's own greedy continuations of corpus windows, so the labels
(the target's argmax at each position) are exactly the tokens that verification
accepts. Each training sequence carries many anchors; the blocks of all anchors
run in one pass under a block-structured mask (a block sees the context
features before its anchor and itself, bidirectionally). Row i of a block is
weighted by exp(-(i-1)/gamma). Target weights, embedding and lm_head are frozen.
The draft is saved in the z-lab layout (bf16), with an acceptance check on
held-out HumanEval prompts through the PyTorch reference.

Usage: draft.py --corpus DIR --target DIR --out DIR --report FILE --minutes 5 --humaneval FILE
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from common import tokenize_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import dflash_reference as ref  # noqa: E402


def draft_config(tcfg, n_layers, block, mask_id):
    layer_ids = ref.default_target_layer_ids(tcfg.num_hidden_layers, n_layers)
    theta = getattr(tcfg, "rope_theta", None) or tcfg.rope_parameters["rope_theta"]
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
            "num_target_layers": tcfg.num_hidden_layers,
            "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layer_ids},
            "hidden_size": tcfg.hidden_size, "num_hidden_layers": n_layers,
            "num_attention_heads": tcfg.num_attention_heads, "num_key_value_heads": tcfg.num_key_value_heads,
            "head_dim": tcfg.head_dim, "intermediate_size": tcfg.intermediate_size,
            "rms_norm_eps": tcfg.rms_norm_eps, "rope_theta": theta,
            "max_position_embeddings": tcfg.max_position_embeddings, "vocab_size": tcfg.vocab_size,
            "hidden_act": "silu", "tie_word_embeddings": False}


@torch.no_grad()
def greedy_continuations(model, prompts, n_new):
    """prompts: [b, P] ids; returns [b, P + n_new] extended greedily (no stop on EOT)."""
    out = model(input_ids=prompts, use_cache=True)
    past = out.past_key_values
    seq = [prompts, out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(n_new - 1):
        out = model(input_ids=seq[-1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        seq.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(seq, dim=1)


def masked_attention(attn, x, ctx, ctx_pos, blk_pos, mask, inv_freq):
    """One draft attention over [ctx ++ blocks] with an explicit visibility mask.
    x: [b, Q, h] normed block rows; ctx: [b, T, h]; mask: [b, Q, T + Q] (True = visible);
    positions are per sequence: blk_pos [b, Q], ctx_pos [b, T]."""
    b, Q, _ = x.shape
    T = ctx.shape[1]
    hd = attn.head_dim
    q = apply_rope_batched(attn.q_norm(attn.q_proj(x).view(b, Q, attn.n_heads, hd)), blk_pos, inv_freq)
    kb = apply_rope_batched(attn.k_norm(attn.k_proj(x).view(b, Q, attn.n_kv_heads, hd)), blk_pos, inv_freq)
    vb = attn.v_proj(x).view(b, Q, attn.n_kv_heads, hd)
    kc = apply_rope_batched(attn.k_norm(attn.k_proj(ctx).view(b, T, attn.n_kv_heads, hd)), ctx_pos, inv_freq)
    vc = attn.v_proj(ctx).view(b, T, attn.n_kv_heads, hd)
    k = torch.cat([kc, kb], 1).transpose(1, 2)
    v = torch.cat([vc, vb], 1).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], enable_gqa=True)
    return attn.o_proj(o.transpose(1, 2).reshape(b, Q, attn.n_heads * hd))


def apply_rope_batched(x, pos, inv_freq):
    """x: [b, n, heads, hd]; pos: [b, n] (per-sequence positions)."""
    ang = pos[..., None].float() * inv_freq[None, None, :]
    cos, sin = torch.cos(ang)[:, :, None, :], torch.sin(ang)[:, :, None, :]
    cos = torch.cat([cos, cos], -1).to(x.dtype)
    sin = torch.cat([sin, sin], -1).to(x.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def draft_anchor_forward(draft, feats, tokens, anchors, embed, mask_id):
    """All blocks of all anchors in one pass. feats: [b, T, L*h]; tokens: [b, T];
    anchors: [b, K] positions. Returns hidden [b, K, B, h] (final-normed)."""
    b, T, _ = feats.shape
    K = anchors.shape[1]
    B = draft.cfg["block_size"]
    dev = feats.device
    offs = torch.arange(B, device=dev)
    blk_pos = (anchors[:, :, None] + offs).reshape(b, K * B)                     # [b, KB]
    blk_tok = torch.full((b, K, B), mask_id, device=dev, dtype=torch.long)
    blk_tok[:, :, 0] = torch.gather(tokens, 1, anchors)
    x = embed(blk_tok.reshape(b, K * B)).to(feats.dtype)
    ctx = draft.hidden_norm(draft.fc(feats))
    ctx_pos = torch.arange(T, device=dev).expand(b, T)
    # Visibility: block k sees context positions < anchor_k and its own B rows.
    q_anchor = anchors[:, :, None].expand(b, K, B).reshape(b, K * B)
    see_ctx = torch.arange(T, device=dev)[None, None, :] < q_anchor[:, :, None]          # [b, KB, T]
    blk_id = torch.arange(K, device=dev).repeat_interleave(B)
    see_blk = (blk_id[:, None] == blk_id[None, :]).expand(b, K * B, K * B)
    mask = torch.cat([see_ctx, see_blk], -1)
    inv_freq = draft.inv_freq.float()
    for layer in draft.layers:
        x = x + masked_attention(layer.self_attn, layer.input_layernorm(x), ctx, ctx_pos, blk_pos, mask, inv_freq)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x).view(b, K, B, -1)


def humaneval_prompts(path):
    prompts = []
    for line in open(path, encoding="utf-8"):
        turn = json.loads(line)["turns"][0]
        body = turn.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        prompts.append(body)
    return prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--humaneval", required=True)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--gamma", type=float, default=5.0)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--gen-minutes", type=float, default=1.5)
    ap.add_argument("--init", help="draft directory to continue training from")
    ap.add_argument("--seed", type=int, default=1, help="data and anchor sampling seed (use a new one when continuing)")
    a = ap.parse_args()
    run(a, smoke=True)    # the whole pipeline at toy scale first: fail in seconds, not minutes
    run(a, smoke=False)


def run(a, smoke):
    device = "cuda"
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    t_start = time.time()
    model = transformers.AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = __import__("tokenizers").Tokenizer.from_file(os.path.join(a.target, "tokenizer.json"))
    mask_id = tok.token_to_id("<|mask|>")
    train = tokenize_file(a.target, os.path.join(a.corpus, "train.txt"), os.path.join(a.corpus, "train.npy"))

    # 1. Greedy continuations of corpus windows: prompt 64..192 tokens, 320 new.
    seqs, prompt_lens = [], []
    n_new, gen_batch = (48, 16) if smoke else (320, 512)
    t0 = time.time()
    while (not seqs) if smoke else time.time() - t0 < a.gen_minutes * 60:
        P = int(rng.integers(64, 193))
        starts = rng.integers(0, len(train) - P, size=gen_batch)
        prompts = torch.from_numpy(np.stack([train[s:s + P] for s in starts]).astype(np.int64)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seqs.append(greedy_continuations(model, prompts, n_new).cpu())
        prompt_lens.append(P)
    gen_s = time.time() - t0
    print(json.dumps({"generated_sequences": len(seqs) * gen_batch, "gen_seconds": round(gen_s, 1)}), flush=True)

    # 2. Train.
    if a.init:   # resume from a previous call's draft with a fresh schedule
        draft = ref.load_draft(a.init, torch.float32).to(device)
    else:
        draft = ref.DFlashDraft(draft_config(model.config, a.layers, 16, mask_id)).to(device)
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.02)
    B = 16
    layer_ids = draft.layer_ids
    embed, lm_head = model.model.embed_tokens, model.lm_head
    weights = torch.exp(-torch.arange(B - 1, device=device, dtype=torch.float32) / a.gamma)
    opt = torch.optim.AdamW(draft.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
    batch, K = 32, 16
    step, total_steps, t0 = 0, None, time.time()
    budget = 2.0 if smoke else a.minutes * 60
    if smoke:
        batch, K = 4, 2
    log = []
    while True:
        if step == 20:
            t20 = time.time()
        if smoke and step == 3:
            total_steps = 3
        elif step == 120:   # schedule length from the measured speed, after start-up
            total_steps = 120 + int((budget - (time.time() - t0)) / ((time.time() - t20) / 100))
        if (smoke and total_steps is not None and step >= total_steps) or (not smoke and time.time() - t0 >= budget):
            break
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / (total_steps or 10 ** 9)))))
        for g in opt.param_groups:
            g["lr"] = lr
        gi = int(rng.integers(0, len(seqs)))
        rows = torch.from_numpy(rng.choice(seqs[gi].shape[0], size=batch, replace=False))
        x = seqs[gi][rows].to(device)
        P, T = prompt_lens[gi], seqs[gi].shape[1]
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[j + 1] for j in layer_ids], -1).float()
            labels = out.logits.argmax(-1)                       # target's prediction for position t+1
        anchors = torch.stack([torch.from_numpy(rng.choice(np.arange(P, T - B + 1), size=K, replace=False))
                               for _ in range(batch)]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = draft_anchor_forward(draft, feats, x, anchors, embed, mask_id)   # [b, K, B, h]
            logits = lm_head(hidden[:, :, 1:]).float()                                # [b, K, B-1, V]
        tgt_idx = (anchors[:, :, None] + torch.arange(B - 1, device=device)).reshape(batch, -1)
        target = torch.gather(labels, 1, tgt_idx).view(batch, K, B - 1)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        loss = (ce.view(batch, K, B - 1) * weights).sum() / (weights.sum() * batch * K)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 300 == 0:
            acc = (logits.argmax(-1) == target).float().mean((0, 1))
            entry = {"step": step, "loss": round(loss.item(), 4), "acc_rows_1_4": [round(v, 3) for v in acc[:4].tolist()],
                     "s": round(time.time() - t0, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
        step += 1
    train_s = time.time() - t0
    draft.eval()
    out_dir = a.out + ("-smoke" if smoke else "")
    ref.save_draft(draft, out_dir, torch.bfloat16)

    # 3. Acceptance on held-out HumanEval prompts with the reference (float32 on the GPU).
    target32 = transformers.AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).to(device).eval()
    draft32 = ref.load_draft(out_dir, torch.float32).to(device)
    prompts = humaneval_prompts(a.humaneval)
    lens_all, same = [], 0
    sample = []
    n_eval, n_tok = (2, 16) if smoke else (40, 128)
    for i, text in enumerate(prompts[:n_eval]):
        ids = tok.encode(text).ids
        spec, lens = ref.dflash_greedy(target32, draft32, ids, n_tok, [0])
        plain = ref.plain_greedy(target32, ids, n_tok, [0]) if i < 10 else None
        if plain is not None:
            same += plain == spec
        lens_all += lens
        if i < 3:
            sample.append(tok.decode(ids + spec))
    tau = sum(lens_all) / len(lens_all)
    report = {"init": a.init, "seed": a.seed, "draft_layers": a.layers, "block_size": B, "gamma": a.gamma, "lr": a.lr, "batch": batch,
              "anchors_per_sequence": K, "steps": step, "train_seconds": round(train_s, 1),
              "generated_sequences": len(seqs) * gen_batch, "generated_tokens_each": n_new,
              "gen_seconds": round(gen_s, 1), "final_loss": round(loss.item(), 4),
              "reference_tau_humaneval_first40": round(tau, 3), "reference_lossless_first10": same,
              "total_seconds": round(time.time() - t_start, 1), "log": log, "samples": sample}
    if smoke:
        print(json.dumps({"smoke_test": "ok", "tau": tau, "lossless": same}), flush=True)
        return
    with open(a.report, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k not in ("log", "samples")}, indent=1), flush=True)


if __name__ == "__main__":
    main()
