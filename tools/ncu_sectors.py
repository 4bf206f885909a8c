#!/usr/bin/env python3
"""Per instruction, the L2 sectors each global access touches against the ideal for its bytes.

Reads the CSV that `ncu --section SourceCounters --page source --print-source sass --csv` prints
(one block a profiled kernel, each opening with a "Kernel Name" row) and prints, for every kernel,
its instructions with global sectors: warp executions, theoretical sectors, ideal sectors and
their ratio, then the kernel's totals. A ratio above 1 means the lanes' addresses touch sectors
that their bytes do not fill (scattered lanes, misaligned rows or shared-memory destinations).

Usage: ncu_sectors.py NCU_SOURCE.csv
"""
import csv
import sys

THEORETICAL = "L2 Theoretical Sectors Global"
IDEAL = "L2 Theoretical Sectors Global Ideal"


def number(text):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return 0.0


def kernels(rows):
    """(name, header, instruction rows) for each kernel block of the CSV."""
    name, header, body = None, None, []
    for row in rows:
        if row and row[0] == "Kernel Name":
            if header:
                yield name, header, body
            name, header, body = row[1] if len(row) > 1 else "?", None, []
        elif row and row[0] == "Address" and name is not None:
            header = row
        elif header and len(row) == len(header):
            body.append(row)
    if header:
        yield name, header, body


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.reader(f))
    found = False
    for name, header, body in kernels(rows):
        if THEORETICAL not in header or IDEAL not in header:
            continue
        found = True
        col = {c: i for i, c in enumerate(header)}
        print(f"## {name}")
        print(f"{'address':>8} | {'SASS':60} | {'warp execs':>10} | {'sectors':>10} | {'ideal':>10} | ratio")
        total = ideal_total = 0.0
        for row in body:
            sectors, ideal = number(row[col[THEORETICAL]]), number(row[col[IDEAL]])
            if sectors == 0:
                continue
            total, ideal_total = total + sectors, ideal_total + ideal
            sass = " ".join(row[col["Source"]].split())[:60]
            execs = number(row[col["Instructions Executed"]]) if "Instructions Executed" in col else 0
            ratio = sectors / ideal if ideal else float("inf")
            print(f"{row[col['Address']][-8:]:>8} | {sass:60} | {execs:10.0f} | {sectors:10.0f} | {ideal:10.0f} | {ratio:5.2f}")
        ratio = total / ideal_total if ideal_total else float("inf")
        print(f"{'total':>8} | {'':60} | {'':>10} | {total:10.0f} | {ideal_total:10.0f} | {ratio:5.2f}\n")
    if not found:
        sys.exit(f"ncu_sectors.py: no kernel with '{THEORETICAL}' columns in {sys.argv[1]}")


if __name__ == "__main__":
    main()
