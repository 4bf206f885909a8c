#!/usr/bin/env python3
"""Step 3: pretrain the target, a Qwen3ForCausalLM of about 16 M parameters
(hidden 384, 8 layers, 6 heads of 64, 2 KV heads, intermediate 1024, tied
embeddings, 2048 positions), on the corpus for a fixed wall-clock budget.
Reports the held-out loss; saves bf16 safetensors (shards under 14 MB), the
generation config and the tokenizer files in --out.

Usage: pretrain.py --corpus DIR --tokenizer DIR --out DIR --minutes 6
"""
import argparse
import json
import math
import os
import shutil
import time

import numpy as np
import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from common import rope_kwargs, tokenize_file


def batches(data, seq_len, batch, rng, device):
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    x = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(x).to(device, non_blocking=True)


@torch.no_grad()
def held_out_loss(model, val, seq_len, device, n_seq=256):
    model.eval()
    losses = []
    for i in range(0, min(n_seq, (len(val) - 1) // seq_len), 32):
        x = np.stack([val[(i + k) * seq_len:(i + k + 1) * seq_len + 1] for k in range(32)
                      if (i + k + 1) * seq_len + 1 <= len(val)]).astype(np.int64)
        x = torch.from_numpy(x).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))
    model.train()
    return float(torch.stack(losses).mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", required=True, help="JSON file for losses, settings and samples")
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--init", help="checkpoint directory to continue from")
    a = ap.parse_args()
    t_start = time.time()
    device = "cuda"
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    train = tokenize_file(a.tokenizer, os.path.join(a.corpus, "train.txt"), os.path.join(a.corpus, "train.npy"))
    val = tokenize_file(a.tokenizer, os.path.join(a.corpus, "val.txt"), os.path.join(a.corpus, "val.npy"))
    print(json.dumps({"train_tokens": len(train), "val_tokens": len(val), "tokenize_s": time.time() - t_start}),
          flush=True)

    cfg = Qwen3Config(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=0,
                      pad_token_id=0, hidden_act="silu", attention_dropout=0.0, **rope_kwargs(Qwen3Config, 10000.0))
    if a.init:   # resume: continue from a previous call's checkpoint with a fresh schedule
        model = Qwen3ForCausalLM.from_pretrained(a.init, dtype=torch.float32).to(device)
    else:
        model = Qwen3ForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=True)
    budget = a.minutes * 60
    warmup = 200
    step, total_steps, t0 = 0, None, time.time()
    log = []
    model.train()
    while True:
        if step == 20:
            t20 = time.time()
        if step == 120:   # schedule length from the measured speed, after start-up
            total_steps = 120 + int((budget - (time.time() - t0)) / ((time.time() - t20) / 100))
        if total_steps is not None and step >= total_steps:
            break
        horizon = total_steps or 10 ** 9
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / horizon))))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batches(train, a.seq_len, a.batch, rng, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 500 == 0:
            entry = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "s": round(time.time() - t0, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
        step += 1
    train_s = time.time() - t0
    val_loss = held_out_loss(model, val, a.seq_len, device)
    os.makedirs(a.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(a.out, max_shard_size="14MB")
    GenerationConfig(eos_token_id=0, pad_token_id=0, do_sample=False).save_pretrained(a.out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer, f), os.path.join(a.out, f))
    report = {"init": a.init, "lr": a.lr, "parameters": n_params, "steps": step, "tokens_seen": step * a.batch * a.seq_len,
              "seq_len": a.seq_len, "batch": a.batch, "train_seconds": round(train_s, 1),
              "final_train_loss": round(loss.item(), 4), "held_out_loss": round(val_loss, 4),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "log": log}
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
    model.eval()
    samples = {}
    for prompt in ("def fibonacci(n):", "import os\n\n\ndef read_config(path):", "class Stack:\n"):
        ids = torch.tensor([tok.encode(prompt).ids], device=device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=0, pad_token_id=0)
        samples[prompt] = tok.decode(out[0].tolist())
    report["samples"] = samples
    with open(a.report, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "log"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
