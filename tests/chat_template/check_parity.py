#!/usr/bin/env python3
"""Renders every case in cases.jsonl with every template directory through
`dflash chat-template` and through Python jinja2 (render_jinja2.py); fails
unless every output is byte-identical (or both fail).

Usage: check_parity.py DFLASH_BINARY TEMPLATE_DIR...
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, data):
    r = subprocess.run(cmd, input=data, capture_output=True, text=True, encoding="utf-8")
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return [json.loads(line) for line in r.stdout.splitlines()]


def main():
    binary, dirs = sys.argv[1], sys.argv[2:]
    cases = open(os.path.join(HERE, "cases.jsonl"), encoding="utf-8").read()
    n_cases = len(cases.splitlines())
    failures = rendered = errors = 0
    for d in dirs:
        ours = run([binary, "chat-template", "--tokenizer", d, "--jsonl", "--keep-going"], cases)
        ref = run([sys.executable, os.path.join(HERE, "render_jinja2.py"), d], cases)
        assert len(ours) == len(ref) == n_cases, (len(ours), len(ref), n_cases)
        for i, (a, b) in enumerate(zip(ours, ref)):
            if isinstance(b, dict):  # jinja2 raised: dflash must fail too
                errors += 1
                if not isinstance(a, dict):
                    failures += 1
                    print(f"{os.path.basename(d)} case {i + 1}: jinja2 failed ({b['error']}) but dflash rendered {a!r}")
                continue
            rendered += 1
            if a != b:
                failures += 1
                print(f"{os.path.basename(d)} case {i + 1}: outputs differ\n  jinja2: {b!r}\n  dflash: {a!r}")
    print(f"{len(dirs)} templates x {n_cases} cases: {rendered} rendered identically, {errors} failed in both, "
          f"{failures} mismatches")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
