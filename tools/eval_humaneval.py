#!/usr/bin/env python3
"""Acceptance of a DFlash pair on the 164 HumanEval prompts, measured with the
dflash binary: each prompt (the code inside the turn's code fence) is
completed plainly and with DFlash, and the two outputs must be equal (greedy,
or sampled with the match scheme and the same seed; the rejection scheme only
keeps the distribution, so its outputs are not compared).
Prints and writes mean tau, per-position acceptance rates and timings.

Usage: eval_humaneval.py --dflash build/dflash [--model DIR --draft DIR] [--max-tokens 128]
                         [--block-size 16] [--limit N] [--out results.json]
                         [--temperature T --top-p P --seed S --spec-sampling match|rejection]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def prompts(path):
    out = []
    for line in open(path, encoding="utf-8"):
        row = json.loads(line)
        out.append((row["task_id"], row["turns"][0].split("```python\n", 1)[1].rsplit("\n```", 1)[0]))
    return out


def generate(a, prompt_file, speculative, seed):
    cmd = [a.dflash, "generate", "--prompt-file", prompt_file, "--max-tokens", str(a.max_tokens), "--json",
           "--speculative", speculative, "--temperature", str(a.temperature), "--top-p", str(a.top_p),
           "--seed", str(seed), "--spec-sampling", a.spec_sampling]
    if a.model:
        cmd += ["--model", a.model]
    if a.draft and speculative == "dflash":
        cmd += ["--draft", a.draft]
    if speculative == "dflash":
        cmd += ["--block-size", str(a.block_size)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", required=True)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--data", default=os.path.join(HERE, "..", "bench", "data", "humaneval.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--out")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i")
    ap.add_argument("--spec-sampling", choices=["match", "rejection"], default="match")
    a = ap.parse_args()
    items = prompts(a.data)[: a.limit]
    B = a.block_size
    hist = [0] * B
    mismatches = []
    t = {"plain_decode_ms": 0.0, "dflash_decode_ms": 0.0, "plain_tokens": 0, "dflash_tokens": 0}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for k, (task_id, text) in enumerate(items):
            f = os.path.join(tmp, "prompt.txt")
            with open(f, "w", encoding="utf-8") as fh:
                fh.write(text)
            plain = generate(a, f, "none", a.seed + k)
            spec = generate(a, f, "dflash", a.seed + k)
            if plain["tokens"] != spec["tokens"] and (a.temperature == 0 or a.spec_sampling == "match"):
                mismatches.append(task_id)
            for i, n in enumerate(spec["acceptance_histogram"]):
                hist[i] += n
            t["plain_decode_ms"] += plain["timings_ms"]["decode"] + plain["timings_ms"]["prefill"]
            t["dflash_decode_ms"] += spec["timings_ms"]["decode"] + spec["timings_ms"]["prefill"]
            t["plain_tokens"] += len(plain["tokens"])
            t["dflash_tokens"] += len(spec["tokens"])
    steps = sum(hist)
    tau = sum((i + 1) * n for i, n in enumerate(hist)) / steps
    # Rate at draft position i: steps that accepted at least i drafted tokens.
    rates = [sum(hist[i:]) / steps for i in range(1, B)]
    res = {"prompts": len(items), "max_tokens": a.max_tokens, "block_size": B, "model": a.model or "bundled",
           "draft": a.draft or "bundled", "temperature": a.temperature, "top_p": a.top_p,
           "seed": a.seed, "spec_sampling": a.spec_sampling, "tau": round(tau, 4), "steps": steps,
           "acceptance_histogram": hist, "per_position_acceptance": [round(r, 4) for r in rates],
           "lossless_mismatches": mismatches,
           "plain_tok_per_s": round(1000 * t["plain_tokens"] / t["plain_decode_ms"], 1),
           "dflash_tok_per_s": round(1000 * t["dflash_tokens"] / t["dflash_decode_ms"], 1),
           "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
