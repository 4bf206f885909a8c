#!/usr/bin/env python3
"""A short reading of an Nsight Compute report of a few kernels (scripts/device-test.sh's ncu steps).

    python3 tools/ncu_summary.py DETAILS.txt SASS.csv [--top N] [--hot MIN]

DETAILS.txt: `ncu -i R --print-details all`; SASS.csv: `ncu -i R --page source --csv --print-source sass`, with the
kernels in the same order. For each kernel: its launch, the main lines of the throughput, scheduler, warp-state,
instruction, launch and occupancy sections, then where a warp's instructions go (the cumulative instructions a warp
at each wait, barrier, run of tensor-core products and exit: the first instruction runs once a warp, so its count is
the warps) and the instructions with the most stall samples. --hot MIN adds, in address order, every instruction a
warp executes MIN times or more with its count a warp and its stall samples: a kernel's loop bodies (a product's
per-chunk instructions, with MIN below its chunks a warp).
"""
import argparse
import csv
import io
import re

SECTIONS = ("GPU Speed Of Light Throughput", "Scheduler Statistics", "Warp State Statistics",
            "Instruction Statistics", "Launch Statistics", "Occupancy")
MARKERS = re.compile(r"\b(ACQBULK|BAR\.\S+|HMMA\.\S+|HGMMA\.\S+|LDGDEPBAR|DEPBAR\S*|EXIT|MEMBAR\S*)\b")


def details(path):
    """[(kernel line, [section lines])] from --print-details all output: each section's first table."""
    kernels, lines = [], open(path, errors="replace").read().split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^  \S.*\)x\(\d+, \d+, \d+\), Context", line):
            name = line.strip().split("(")[0].strip()
            grid = re.search(r"\((\d+, \d+, \d+)\)x\((\d+, \d+, \d+)\)", line).group(0)
            kernels.append((f"{name} {grid}", []))
        m = re.match(r"^    Section: (.*)$", line)
        if m and kernels and m.group(1).strip() in SECTIONS:
            out = kernels[-1][1]
            out.append("-- " + m.group(1).strip())
            dashes, j = 0, i + 1
            while j < len(lines) and dashes < 3:
                t = lines[j].strip()
                if t.startswith("---"):
                    dashes += 1
                elif dashes == 2 and t:
                    out.append(re.sub(r"\s{2,}", "  ", t))
                j += 1
            i = j
            continue
        i += 1
    return kernels


def sass(path):
    """[(header, rows)] a kernel, from the --page source csv (a header row per kernel)."""
    text = open(path, errors="replace").read().split("\n")
    starts = [i for i, l in enumerate(text) if l.startswith('"Kernel Name"')] + [len(text)]
    out = []
    for a, b in zip(starts, starts[1:]):
        rows = list(csv.reader(io.StringIO("\n".join(text[a + 1:b]))))
        if not rows:
            continue
        hdr = rows[0]
        out.append((hdr, [r for r in rows[1:] if len(r) == len(hdr)]))
    return out


def counters(hdr, rows):
    """A row's executed instructions and stall samples (functions of a row), and the kernel's warps."""
    executed = hdr.index("Instructions Executed")
    stalls = hdr.index("Warp Stall Sampling (All Samples)")
    count = lambda r: int(r[executed] or 0)
    samples = lambda r: int(r[stalls] or 0)
    return count, samples, count(rows[0]) if rows else 0


def hot(hdr, rows, least):
    """The instructions executed `least` times a warp or more, in address order."""
    count, samples, warps = counters(hdr, rows)
    if not warps:
        return []
    picked = [r for r in rows if count(r) >= least * warps]
    out = [f"instructions executed {least}+ times a warp: {len(picked)} (times a warp, stall samples, instruction):"]
    out += [f"  {count(r) / warps:8.1f} {samples(r):6d}  {r[1].strip()[:90]}" for r in picked]
    return out


def timeline(hdr, rows, top):
    count, samples_of, warps = counters(hdr, rows)
    if not warps:
        return ["(no instructions executed)"]
    total = sum(count(r) for r in rows)
    samples = sum(samples_of(r) for r in rows)
    branches = sum(count(r) for r in rows if re.search(r"(^|\s)BRA\b", r[1].strip()))
    out = [f"warps {warps}, instructions a warp {total / warps:.0f} ({branches / warps:.0f} branches), "
           f"stall samples {samples}",
           "instructions a warp before each marker (executed ones):"]
    cum, last = 0, None
    listed, runs, position = [], [], []  # position: instructions a warp up to each row
    for r in rows:
        n = count(r)
        cum += n
        position.append(cum / warps)
        m = MARKERS.search(r[1])
        if m and n:
            op = m.group(1).split(".")[0]
            if op in ("HMMA", "HGMMA") and last == op:
                runs[-1] += 1  # products with no other marker between them: counted on the first
            else:
                listed.append(f"  {cum / warps:8.1f}  {r[1].strip()[:70]}")
                runs.append(1)
            last = op
    out += [line + (f"  (x{n})" if n > 1 else "") for line, n in zip(listed, runs)]
    out.append(f"top {top} instructions by stall samples (samples, instructions a warp so far, instruction):")
    for i in sorted(range(len(rows)), key=lambda i: -samples_of(rows[i]))[:top]:
        out.append(f"  {samples_of(rows[i]):5d} {position[i]:8.1f}  {rows[i][1].strip()[:70]}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("details")
    ap.add_argument("sass")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--hot", type=float, default=0, help="list instructions executed this many times a warp or more")
    args = ap.parse_args()
    kernels, code = details(args.details), sass(args.sass)
    # The csv may list a kernel twice in a row (once per source view); keep one of each.
    unique = []
    for hdr, rows in code:
        sig = (len(rows), sum(int(r[hdr.index("Instructions Executed")] or 0) for r in rows))
        if unique and unique[-1][0] == sig:
            continue
        unique.append((sig, hdr, rows))
    for k, (name, lines) in enumerate(kernels):
        print(f"== {name}")
        for line in lines:
            print("  " + line)
        if k < len(unique):
            for line in timeline(unique[k][1], unique[k][2], args.top):
                print("  " + line)
            if args.hot > 0:
                for line in hot(unique[k][1], unique[k][2], args.hot):
                    print("  " + line)
        print()


if __name__ == "__main__":
    main()
