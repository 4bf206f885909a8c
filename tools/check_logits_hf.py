#!/usr/bin/env python3
"""Compares `dflash logits` output with Hugging Face transformers on the same
checkpoint and prompt: transformers in float32 (the reference) and in bfloat16
(what an engine in bf16 can hope for). Prints and returns the relative L2
errors; exits 1 when dflash's error against float32 exceeds --bound.

Usage: check_logits_hf.py MODEL_DIR DFLASH_LOGITS.f32 --prompt-ids 1,2,3 [--bound 1e-2] [--json OUT]
"""
import argparse
import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def hf_logits(model_dir, ids, dtype):
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    with torch.no_grad():
        out = m(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    del m
    torch.cuda.empty_cache()
    return out


def rel(a, ref):
    return float(np.linalg.norm((a - ref).ravel()) / np.linalg.norm(ref.ravel()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("logits")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--bound", type=float, default=1e-2)
    ap.add_argument("--json")
    a = ap.parse_args()
    ids = [int(x) for x in a.prompt_ids.split(",")]
    ref32 = hf_logits(a.model, ids, torch.float32)
    ref16 = hf_logits(a.model, ids, torch.bfloat16)
    ours = np.fromfile(a.logits, dtype=np.float32).reshape(ref32.shape)
    res = {
        "model": a.model, "n_tokens": len(ids),
        "dflash_vs_hf_fp32": rel(ours, ref32), "hf_bf16_vs_hf_fp32": rel(ref16, ref32),
        "dflash_vs_hf_bf16": rel(ours, ref16),
        "argmax_agreement_dflash_hf_fp32": float((ours.argmax(-1) == ref32.argmax(-1)).mean()),
    }
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["dflash_vs_hf_fp32"] <= a.bound else 1


if __name__ == "__main__":
    sys.exit(main())
