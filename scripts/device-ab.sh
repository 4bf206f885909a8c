#!/usr/bin/env bash
# A/B of kernel libraries on the GPU machine: one dflash binary (the CUDA backend lives in
# libdflash_cuda.so) run with each library in turn, alternating, so that every variant sees the
# same machine, checkpoints and clocks.
#
#   bash scripts/device-ab.sh pack NAME=LIB [NAME=LIB ...]  # here, after `device-test.sh build`: build-dev's
#                                                          # dflash, dflash_tests and libraries, and each
#                                                          # variant's libdflash_cuda.so, into build-ab/carry.tar.xz
#   bash scripts/device-test.sh slim models                # then a device call carrying build-ab/carry.tar.xz:
#   VARIANTS="base new" bash scripts/device-ab.sh run OUT   # there
#
# run's settings: VARIANTS (names given to pack, in the order they alternate), MODELS ("moe12" = 12
# layers of the 30B-A3B shape, "8b" = the 8B shape; default moe12), BATCHES / BATCHES_8B, ROUNDS /
# ROUNDS_8B, CONTEXT (512); TRACE="NAME ..." adds a CUPTI kernel trace of those variants on moe12 at
# TRACE_BATCH (1); TESTS=FILTER runs dflash_tests --gtest_filter=FILTER with the last variant (the
# bundled-pair tests need `slim` instead of `slim models`). A device call returns at most 8 files, so
# OUT gets three: summary.txt (every variant's ms a step side by side, tools/ab_table.py, rewritten
# after each round: a call stopped by its time limit still returns the rounds done), tests.txt, and
# extra.tar.xz with the rest (the per-variant bench-step outputs extra/builds_MODEL_NAME.txt, traces).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: device-ab.sh pack NAME=LIB ... | run OUT}

if [ "$mode" = pack ]; then
  shift
  [ $# -ge 1 ] || { echo "usage: device-ab.sh pack NAME=LIB [NAME=LIB ...]" >&2; exit 2; }
  [ -x build-dev/dflash ] || { echo "build-dev/dflash is missing: run 'bash scripts/device-test.sh build' first" >&2; exit 1; }
  for pair in "$@"; do
    name=${pair%%=*} lib=${pair#*=}
    if [ "$name" = common ] || ! [[ $name =~ ^[A-Za-z0-9_-]+$ ]] || [ ! -f "$lib" ]; then
      echo "not NAME=LIB with an existing LIB (and a NAME other than common): $pair" >&2
      exit 2
    fi
  done
  rm -rf build-ab && mkdir -p build-ab/common
  cp build-dev/dflash build-ab/common/
  if [ -x build-dev/tests/dflash_tests ]; then cp build-dev/tests/dflash_tests build-ab/common/; fi
  for lib in build-dev/lib/*; do [ "$(basename "$lib")" = libdflash_cuda.so ] || cp "$lib" build-ab/common/; done
  names=()
  for pair in "$@"; do
    name=${pair%%=*} lib=${pair#*=}
    mkdir -p "build-ab/$name/lib" && strip -o "build-ab/$name/lib/libdflash_cuda.so" "$lib"
    names+=("$name")
  done
  (cd build-ab && tar -c common "${names[@]}" | xz --x86 --lzma2=preset=9e -T"$(nproc)" > carry.tar.xz)
  ls -la build-ab/carry.tar.xz
  exit 0
fi

[ "$mode" = run ] || { echo "unknown mode $mode" >&2; exit 2; }
out=${2:?usage: device-ab.sh run OUT}
mkdir -p "$out" "$out/extra"
tar -xJf build-ab/carry.tar.xz -C build-ab
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
# cuBLASLt comes from the machine: the CUDA toolkit, else the copy PyTorch ships.
if ! ldconfig -p | grep -q libcublasLt.so.13 && [ ! -e /usr/local/cuda/lib64/libcublasLt.so.13 ]; then
  nv=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null || true)
  [ -n "$nv" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nv"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$out/extra/gpu.txt" 2>&1 || true
read -ra variants <<< "${VARIANTS:?VARIANTS: the names given to pack}"
models=${MODELS:-moe12}
ck=${CKPT_DIR:-/tmp/dflash-ab}
start=$(date +%s)
log_time() { echo "t=$(( $(date +%s) - start )) s: $*" >> "$out/extra/timing.txt"; }
# The checkpoints (tools/make_random_checkpoint.py; the seeds of device-test.sh's).
pids=()
python3 tools/make_random_checkpoint.py qwen3-30b-a3b "$ck/moe12" --layers 12 --seed 4 > /dev/null & pids+=($!)
python3 tools/make_random_checkpoint.py dflash-30b-a3b "$ck/d12" --target-layers 12 --seed 5 > /dev/null & pids+=($!)
if [[ " $models " == *" 8b "* ]]; then
  python3 tools/make_random_checkpoint.py qwen3-8b "$ck/8b" --seed 2 > /dev/null & pids+=($!)
  python3 tools/make_random_checkpoint.py dflash-8b "$ck/d8b" --seed 3 > /dev/null & pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid"; done
log_time "checkpoints written"
run_variant() {  # NAME, dflash arguments...
  local name=$1
  shift
  LD_LIBRARY_PATH="$PWD/build-ab/$name/lib:$PWD/build-ab/common:$LD_LIBRARY_PATH" build-ab/common/dflash "$@"
}
status=0
for model in $models; do
  if [ "$model" = 8b ]; then
    pair=(--model "$ck/8b" --draft "$ck/d8b") batches=${BATCHES_8B:-1,8,32} rounds=${ROUNDS_8B:-2}
  else
    pair=(--model "$ck/moe12" --draft "$ck/d12") batches=${BATCHES:-1,2,8,16,32} rounds=${ROUNDS:-3}
  fi
  for round in $(seq "$rounds"); do
    for name in "${variants[@]}"; do
      echo "== $model round $round: $name ==" >> "$out/extra/builds_${model}_$name.txt"
      run_variant "$name" bench-step --device cuda "${pair[@]}" --batch "$batches" --context "${CONTEXT:-512}" \
        --skip-kernels --leak-check-steps 0 >> "$out/extra/builds_${model}_$name.txt" 2>&1 || status=1
      log_time "$model round $round $name"
    done
    for done_model in $models; do
      python3 tools/ab_table.py "$out/extra" "$done_model" "${variants[@]}" || status=1
      echo
      [ "$done_model" = "$model" ] && break
    done > "$out/summary.txt"
  done
done
for name in ${TRACE:-}; do
  DFLASH_TRACE_NODES=400 CUDA_INJECTION64_PATH="$PWD/build-ab/common/libdflash_kernel_trace.so" \
    DFLASH_TRACE_OUT="$out/extra/trace_$name.txt" run_variant "$name" bench-step --device cuda --model "$ck/moe12" \
    --draft "$ck/d12" --batch "${TRACE_BATCH:-1}" --context "${CONTEXT:-512}" --iters 20 --warmup 3 --skip-kernels \
    --leak-check-steps 0 > "$out/extra/trace_run_$name.txt" 2>&1 || status=1
  log_time "trace $name"
done
if [ -n "${TESTS:-}" ]; then
  export DFLASH_FIXTURES_DIR="$PWD/tests/fixtures" DFLASH_MODELS_DIR="$PWD/models"
  last=${variants[${#variants[@]}-1]}
  LD_LIBRARY_PATH="$PWD/build-ab/$last/lib:$PWD/build-ab/common:$LD_LIBRARY_PATH" build-ab/common/dflash_tests \
    --gtest_filter="$TESTS" > "$out/tests.txt" 2>&1 || status=1
  log_time "tests ($last)"
fi
tar -cJf "$out/extra.tar.xz" -C "$out" extra && rm -rf "$out/extra"
exit $status
