#!/usr/bin/env bash
# Registers, spills and static shared memory of every kernel instantiation in CUDA files, as ptxas
# reports them for the device build (build-dev/, `bash scripts/device-test.sh build` first):
#
#   bash scripts/kernel-registers.sh src/kernels/cuda/skinny_gemm.cu [more .cu files]
#
# A form that crosses a register boundary loses blocks an SM, which no step time shows as such;
# compare this table before and after a kernel change (docs/design.md, "Registers").
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: kernel-registers.sh FILE.cu [FILE.cu ...]" >&2; exit 2; }
flags=build-dev/CMakeFiles/dflash_cuda.dir/flags.make
[ -f "$flags" ] || { echo "$flags is missing: run 'bash scripts/device-test.sh build' first" >&2; exit 1; }
cuda_flags=$(sed -n 's/^CUDA_FLAGS = //p' "$flags")
for file in "$@"; do
  echo "== $file"
  # shellcheck disable=SC2086  # the build's flags, one word each
  (cd build-dev && /usr/local/cuda/bin/nvcc --options-file CMakeFiles/dflash_cuda.dir/includes_CUDA.rsp $cuda_flags \
     -Xptxas -v -c "../$file" -o /dev/null 2>&1) | python3 -c '
import re, subprocess, sys
rows, name, spill = [], None, 0
for line in sys.stdin:
    m = re.search(r"Compiling entry function .(_Z\S+).", line)
    if m:
        name, spill = m.group(1), 0
        continue
    m = re.search(r"(\d+) bytes spill stores", line)
    if m:
        spill = int(m.group(1))
    m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
    if m and name:
        rows.append((name, int(m.group(1)), spill, int(m.group(2) or 0)))
        name = None
names = subprocess.run(["c++filt"], input="\n".join(r[0] for r in rows), capture_output=True, text=True).stdout.split("\n")
print("registers spill B  smem B  kernel")
for (_, regs, spill, smem), full in sorted(zip(rows, names), key=lambda x: x[1]):
    short = re.sub(r"\(.*$", "", re.sub(r"^void ", "", re.sub(r"\(anonymous namespace\)::", "", full)))
    print(f"{regs:>9} {spill:>7} {smem:>7}  {short}")
'
done
