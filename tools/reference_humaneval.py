#!/usr/bin/env python3
"""PyTorch reference outputs of a DFlash pair on the first N HumanEval prompts:
prompt ids, plain greedy tokens, DFlash greedy tokens and acceptance lengths
(tools/dflash_reference.py, float32). The engine's outputs are tested against them.

Usage: reference_humaneval.py --model DIR --draft DIR --out FILE [--n 10] [--max-tokens 128]
"""
import argparse
import json
import os
import sys

import torch
import transformers
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_reference as ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "bench", "data", "humaneval.jsonl"))
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(dev).eval()
    draft = ref.load_draft(a.draft, torch.float32).to(dev)
    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    eos = [0]
    rows = []
    for line in list(open(a.data, encoding="utf-8"))[: a.n]:
        text = json.loads(line)["turns"][0].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        ids = tok.encode(text).ids
        plain = ref.plain_greedy(model, ids, a.max_tokens, eos)
        spec, lens = ref.dflash_greedy(model, draft, ids, a.max_tokens, eos)
        rows.append({"prompt_ids": ids, "plain": plain, "dflash": spec, "acceptance": lens})
        print(len(rows), sum(lens) / len(lens), plain == spec, flush=True)
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "draft": a.draft, "max_tokens": a.max_tokens, "block_size": 16,
                   "eos_ids": eos, "dtype": "float32", "device": dev, "rows": rows}, f)


if __name__ == "__main__":
    main()
