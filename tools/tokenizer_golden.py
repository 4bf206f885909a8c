#!/usr/bin/env python3
"""Golden token ids from Hugging Face `tokenizers` for a corpus of JSON strings.

Writes one JSON object per corpus line: {"ids": [...], "rt": bool} where ids is
encode(text, add_special_tokens=False) and rt says whether decode(ids) == text;
with --with-special also "ids_special" (add_special_tokens=True).

Usage: tokenizer_golden.py --tokenizer DIR --corpus corpus.jsonl --out ids.jsonl [--every N] [--with-special]
"""
import argparse
import json
import os

from tokenizers import Tokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--every", type=int, default=1, help="keep every N-th corpus line")
    ap.add_argument("--with-special", action="store_true")
    a = ap.parse_args()
    tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
    n = rt = 0
    with open(a.corpus, encoding="utf-8") as f, open(a.out, "w", encoding="utf-8") as out:
        for i, line in enumerate(f):
            if i % a.every:
                continue
            text = json.loads(line)
            ids = tok.encode(text, add_special_tokens=False).ids
            row = {"text": text, "ids": ids, "rt": tok.decode(ids, skip_special_tokens=False) == text}
            if a.with_special:
                row["ids_special"] = tok.encode(text, add_special_tokens=True).ids
            out.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
            n += 1
            rt += row["rt"]
    print(json.dumps({"tokenizer": a.tokenizer, "strings": n, "round_trip": rt}))


if __name__ == "__main__":
    main()
