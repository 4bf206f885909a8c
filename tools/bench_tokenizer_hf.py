#!/usr/bin/env python3
"""Single-thread encode throughput of Hugging Face `tokenizers` on a JSONL file
of strings, in the JSON shape of `dflash tokenize --bench` (cold and warm pass).

Usage: RAYON_NUM_THREADS=1 bench_tokenizer_hf.py --tokenizer DIR --corpus FILE
"""
import argparse
import json
import os
import time

from tokenizers import Tokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--corpus", required=True)
    a = ap.parse_args()
    tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
    texts = [json.loads(line) for line in open(a.corpus, encoding="utf-8")]
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    out = {"strings": len(texts), "bytes": nbytes}
    for name in ("cold", "warm"):
        t0 = time.perf_counter()
        tokens = 0
        for t in texts:
            tokens += len(tok.encode(t, add_special_tokens=False).ids)
        s = time.perf_counter() - t0
        out[name] = {"seconds": s, "MB_per_s": nbytes / s / 1e6, "tokens": tokens}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
