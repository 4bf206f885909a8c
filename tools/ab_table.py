#!/usr/bin/env python3
"""One table of step times from bench-step outputs of several variants (scripts/device-ab.sh).

    ab_table.py DIR MODEL VARIANT [VARIANT ...]

reads DIR/builds_MODEL_VARIANT.txt (the `dflash bench-step` outputs of every round, appended) and
prints, per step (mode, batch, context), the ms of each round for each variant, in the order given.
"""
import re
import sys
from collections import defaultdict

ROW = re.compile(r"^(plain|dflash)\s+(\d+)\s+(\d+)\s+([\d.]+)\s")


def rounds(path):
    """{(mode, batch, context): [ms of each round]} of one variant's file (empty if it is missing)."""
    times = defaultdict(list)
    try:
        with open(path) as f:
            for line in f:
                m = ROW.match(line)
                if m:
                    times[(m.group(1), int(m.group(2)), int(m.group(3)))].append(m.group(4))
    except FileNotFoundError:
        pass
    return times


def table(directory, model, variants):
    per = {v: rounds(f"{directory}/builds_{model}_{v}.txt") for v in variants}
    steps = sorted({k for t in per.values() for k in t}, key=lambda k: (k[2], k[0] != "plain", k[1]))
    width = max([len(v) for v in variants] + [6 * max([len(t[k]) for t in per.values() for k in t] or [1])]) + 2
    header = f"  {'step':18s}" + "".join(f"{v:{width}s}" for v in variants)
    lines = [f"{model}: ms a step, one value a round", header.rstrip()]
    for k in steps:
        name = f"{k[0]} {k[1]} ctx {k[2]}"
        lines.append(f"  {name:18s}" + "".join(f"{' '.join(per[v].get(k, [])):{width}s}" for v in variants).rstrip())
    return "\n".join(lines)


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__.strip())
    print(table(sys.argv[1], sys.argv[2], sys.argv[3:]))


if __name__ == "__main__":
    main()
