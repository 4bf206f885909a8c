#!/usr/bin/env bash
# GPU tests and benchmarks. The GPU machine has no package registry, so the
# build happens where the Debian packages are and the binaries travel:
#
#   bash scripts/device-test.sh build       # portable build into build-dev/ (the kernels in libdflash_cuda.so, shared
#                                           # by dflash and dflash_tests; every .so they need in lib/),
#                                           # packed into build-dev/carry.tar.xz
#   bash scripts/device-test.sh pack-builds BASELINE_DFLASH   # two builds for STEPS=builds (build-ab/carry.tar.xz)
#   bash scripts/device-test.sh slim        # before a device call: set aside what the GPU steps never read
#   bash scripts/device-test.sh slim models # the same and the bundled pair (for steps other than tests and
#                                           # serving: room for pack-builds' two builds)
#   bash scripts/device-test.sh unslim      # after it: put it back
#   bash scripts/device-test.sh run OUT     # on the GPU machine, from the repository root, with build-dev/ (or
#                                           # just build-dev/carry.tar.xz) there:
#                                           #   CUDA kernel and engine tests, logits vs transformers, bench-step,
#                                           #   serving sweeps
#
# `run` needs python3 with torch, transformers and safetensors (the device has them) for the
# random 8B-shaped checkpoints (tools/make_random_checkpoint.py) and the logits check.
# Steps can be chosen with STEPS="fixtures-moe fixtures-qwen3_5 fixtures-qwen3_next tests logits sites bench bench-moe bench-qwen3_5 profile ab builds serving
# serving-moe ttft sampling ncu ncu-decode ncu-moe-b1 ncu-sectors graphs tp serving-tp" (default: tests logits bench serving; tp and
# serving-tp need a kind with several GPUs, TP of them). STEPS=builds BUILDS_MODEL=moe12 times two builds
# on 12 layers of the 30B-A3B shape instead of the 8B-shaped pair.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: device-test.sh build | run OUT}

# A device call carries the tracked tree and the carried files, 64 MiB in all. The GPU steps read
# neither the tokenizer's golden encodings (CPU tests) nor bench/results: `slim` moves them into
# build-dev/aside/ (ignored), `unslim` moves them back. `slim models` also sets aside the bundled
# pair (31 MB), which only the CUDA tests and the bundled serving sweep read.
aside=(tests/fixtures/tokenizers/tokenizer_golden.tar.xz bench/results)
bundled=(models/pycoder-16m models/pycoder-16m-dflash-b16)
if [ "$mode" = unslim ] || { [ "$mode" = slim ] && [ "${2:-}" = models ]; }; then aside+=("${bundled[@]}"); fi
if [ "$mode" = slim ] || [ "$mode" = unslim ]; then
  for path in "${aside[@]}"; do
    if [ "$mode" = slim ] && [ -e "$path" ]; then
      mkdir -p "build-dev/aside/$(dirname "$path")" && mv "$path" "build-dev/aside/$path"
    elif [ "$mode" = unslim ] && [ -e "build-dev/aside/$path" ]; then
      if [ -e "$path" ]; then echo "$path exists; its set-aside copy stays in build-dev/aside/$path" >&2; exit 1; fi
      mv "build-dev/aside/$path" "$path"
    fi
  done
  [ "$mode" = slim ] || exit 0
  tree=$( (git ls-files -z | xargs -0 stat -c %s 2>/dev/null || true) | awk '{n += $1} END {print n + 0}')
  carry=$(stat -c %s build-dev/carry.tar.xz 2>/dev/null || echo 0)
  echo "tracked tree $((tree / 1024)) KiB + build-dev/carry.tar.xz $((carry / 1024)) KiB (a device call: 65536 KiB)"
  exit 0
fi

# What a device call carries: this build's binaries and libraries (the profiler's apart, in
# carry-profile.tar.xz; STEPS=profile carries both, with models/ set aside too), packed by
# xz -9e with the x86 filter (about 40% smaller than tar -J; the tree and the carried files
# share a 64 MiB limit). Extra tar arguments add to the build's files.
pack_build() {
  local archive=$1
  shift
  tar -c build-dev/dflash build-dev/tests/dflash_tests --exclude=libcupti.so.13 --exclude=libdflash_kernel_trace.so \
    build-dev/lib "$@" | xz --x86 --lzma2=preset=9e -T1 > "$archive"
}

if [ "$mode" = build ]; then
  # The GPU machine's libstdc++ may be older than this one's: the binaries take this one from lib/.
  cmake -S . -B build-dev -DCMAKE_BUILD_TYPE=Release -DDFLASH_NATIVE=OFF -DDFLASH_TESTS=ON \
    -DDFLASH_CUDA_ARCHITECTURES="${DFLASH_CUDA_ARCHITECTURES:-90a}" -DDFLASH_SHARED_KERNELS=ON \
    -DCMAKE_EXE_LINKER_FLAGS=""  # (earlier device builds linked libstdc++ statically)
  cmake --build build-dev -j "$(nproc)" --target dflash dflash_tests dflash_kernel_trace
  strip build-dev/dflash build-dev/tests/dflash_tests build-dev/libdflash_cuda.so
  mkdir -p build-dev/lib
  for lib in $(ldd build-dev/dflash build-dev/tests/dflash_tests build-dev/libdflash_kernel_trace.so |
               awk '/pcre2|utf8proc|gomp|httplib|ssl|crypto|brotli|libz\.|cupti|stdc\+\+|gcc_s/ {print $3}' | sort -u); do
    cp -L "$lib" build-dev/lib/
  done
  cp build-dev/libdflash_cuda.so build-dev/libdflash_kernel_trace.so build-dev/lib/
  pack_build build-dev/carry.tar.xz
  tar -c build-dev/lib/libcupti.so.13 build-dev/lib/libdflash_kernel_trace.so | xz -9e > build-dev/carry-profile.tar.xz
  ls -la build-dev/dflash build-dev/tests/dflash_tests build-dev/lib build-dev/carry*.tar.xz
  echo "carry build-dev/carry.tar.xz; run 'bash scripts/device-test.sh slim' before the device call, 'unslim' after"
  exit 0
fi

if [ "$mode" = pack-builds ]; then
  # Two builds for STEPS=builds (A/B of code changes that have no switch): after `build`, packs
  # this build (as `build` does, tests included) with a baseline dflash binary (built the same way
  # from another commit) into build-ab/carry.tar.xz, the file to carry instead of build-dev's.
  # The baseline's kernels library (lib/libdflash_cuda.so beside it) goes with it.
  base=${2:?usage: device-test.sh pack-builds BASELINE_DFLASH}
  rm -rf build-ab && mkdir -p build-ab/base/build-dev/lib
  cp "$base" build-ab/base/build-dev/dflash
  base_lib="$(dirname "$base")/lib/libdflash_cuda.so"
  if [ -f "$base_lib" ]; then cp "$base_lib" build-ab/base/build-dev/lib/; fi
  pack_build build-ab/carry.tar.xz -C build-ab base/build-dev
  ls -la build-ab/carry.tar.xz
  exit 0
fi

[ "$mode" = run ] || { echo "unknown mode $mode" >&2; exit 2; }
out=${2:?usage: device-test.sh run OUT}
mkdir -p "$out"
for carried in build-dev/carry*.tar.xz; do if [ -f "$carried" ]; then tar -xJf "$carried"; fi; done
if [ -f build-ab/carry.tar.xz ]; then tar -xJf build-ab/carry.tar.xz; fi
steps=${STEPS:-tests logits bench serving}
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
# cuBLASLt comes from the machine: the CUDA toolkit, else the copy PyTorch ships.
if ! ldconfig -p | grep -q libcublasLt.so.13 && [ ! -e /usr/local/cuda/lib64/libcublasLt.so.13 ]; then
  nv=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null || true)
  [ -n "$nv" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nv"
fi
export DFLASH_FIXTURES_DIR="$PWD/tests/fixtures" DFLASH_MODELS_DIR="$PWD/models"
# The carried libraries (build-dev/lib) are seen by our binaries only, never by python3.
with_libs() { LD_LIBRARY_PATH="$PWD/build-dev/lib:$LD_LIBRARY_PATH" "$@"; }
printf '#!/bin/sh\nLD_LIBRARY_PATH="%s:$LD_LIBRARY_PATH" exec "%s" "$@"\n' "$PWD/build-dev/lib" "$PWD/build-dev/dflash" \
  > build-dev/dflash-run
chmod +x build-dev/dflash-run
dflash=build-dev/dflash-run
ckpt=${CKPT_DIR:-/tmp/dflash-ckpt}
# The random 8B-shaped target and draft that bench-step and the profiling steps time, written once
# (the disk does not hold them beside a full-size MoE or Qwen3.5 target: a step before may have left one).
random_8b_pair() {
  if [ ! -f "$ckpt/qwen3-8b/config.json" ]; then
    rm -rf "$ckpt/qwen3-8b" "$ckpt/qwen3-30b-a3b" "$ckpt/qwen3_5-27b"
    python3 tools/make_random_checkpoint.py qwen3-8b "$ckpt/qwen3-8b" --seed 2
  fi
  [ -f "$ckpt/dflash-8b/config.json" ] || python3 tools/make_random_checkpoint.py dflash-8b "$ckpt/dflash-8b" --seed 3
}
# The random 30B-A3B-shaped MoE target (about 61 GB) and a dense draft for it. The disk holds it
# or the 8B pair, not both.
random_moe_pair() {
  if [ ! -f "$ckpt/qwen3-30b-a3b/config.json" ]; then
    rm -rf "$ckpt/qwen3-8b" "$ckpt/dflash-8b" "$ckpt/qwen3-30b-a3b" "$ckpt/qwen3-30b-a3b-12l"
    python3 tools/make_random_checkpoint.py qwen3-30b-a3b "$ckpt/qwen3-30b-a3b" --seed 4
  fi
  [ -f "$ckpt/dflash-30b-a3b/config.json" ] ||
    python3 tools/make_random_checkpoint.py dflash-30b-a3b "$ckpt/dflash-30b-a3b" --seed 5
}
# 12 layers of the 30B-A3B shape (about 16 GB, beside the 8B pair) and a draft for 12 target
# layers: A/B runs of the routed kernels in seconds (a layer's time is the full shape's).
random_moe12_pair() {
  [ -f "$ckpt/qwen3-30b-a3b-12l/config.json" ] ||
    python3 tools/make_random_checkpoint.py qwen3-30b-a3b "$ckpt/qwen3-30b-a3b-12l" --layers 12 --seed 4
  [ -f "$ckpt/dflash-30b-a3b-12l/config.json" ] ||
    python3 tools/make_random_checkpoint.py dflash-30b-a3b "$ckpt/dflash-30b-a3b-12l" --target-layers 12 --seed 5
}
# The random Qwen3.5-27B-shaped target (about 54 GB; alone on the disk) and a DFlash draft for it.
random_qwen3_5_pair() {
  if [ ! -f "$ckpt/qwen3_5-27b/config.json" ]; then
    rm -rf "$ckpt/qwen3-8b" "$ckpt/dflash-8b" "$ckpt/qwen3-30b-a3b" "$ckpt/dflash-30b-a3b" "$ckpt/qwen3-30b-a3b-12l"
    python3 tools/make_random_checkpoint.py qwen3_5-27b "$ckpt/qwen3_5-27b" --seed 6
  fi
  [ -f "$ckpt/dflash-qwen3_5-27b/config.json" ] ||
    python3 tools/make_random_checkpoint.py dflash-qwen3_5-27b "$ckpt/dflash-qwen3_5-27b" --seed 7
}
# The Qwen3 tokenizer (from the test fixtures) into a random checkpoint, for the server.
add_tokenizer() { tar -xJf tests/fixtures/tokenizers/qwen3.tar.xz -C "$ckpt" && cp "$ckpt"/qwen3/tokenizer*.json "$1/"; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
status=0

# Test fixtures written by transformers here (tools/make_fixtures.py --only KIND); tests/fixtures
# keeps them and they come back as $out/fixtures_KIND.tar.xz. KIND: moe (Qwen3-MoE), qwen3_5
# (the Qwen3.5 hybrids), qwen3_next (Qwen3-Next); FIXTURES_ONLY overrides --only (e.g. moe-trained).
for kind in moe qwen3_5 qwen3_next; do
  [[ " $steps " == *" fixtures-$kind "* ]] || continue
  echo "== $kind fixtures =="
  python3 tools/make_fixtures.py --out tests/fixtures --only "${FIXTURES_ONLY:-$kind}" 2>&1 |
    tee "$out/fixtures_$kind.txt" || status=1
  tar -cJf "$out/fixtures_$kind.tar.xz" tests/fixtures/targets/*"$kind"* tests/fixtures/drafts/*"$kind"* \
    tests/fixtures/expected/*"$kind"* || status=1
done

if [[ $steps == *tests* ]]; then
  echo "== CUDA kernel and engine tests =="
  with_libs build-dev/tests/dflash_tests --gtest_filter='*Cuda*' 2>&1 | tee "$out/tests.txt" || status=1
fi

if [[ $steps == *logits* ]]; then
  echo "== logits vs transformers: 4 layers of the Qwen3-8B shape =="
  python3 tools/make_random_checkpoint.py qwen3-8b "$ckpt/qwen3-8b-l4" --layers 4 --seed 1
  ids=$(python3 -c "import random; r = random.Random(5); print(','.join(str(r.randrange(151936)) for _ in range(200)))")
  "$dflash" logits --device cuda --model "$ckpt/qwen3-8b-l4" --prompt-ids "$ids" --out "$ckpt/l4.f32"
  python3 tools/check_logits_hf.py "$ckpt/qwen3-8b-l4" "$ckpt/l4.f32" --prompt-ids "$ids" \
    --json "$out/logits_vs_hf.json" || status=1
fi

if [[ $steps == *sites* ]]; then
  echo "== logits: which bf16 roundings matter (4 layers of the Qwen3-8B shape, float32 forward) =="
  [ -f "$ckpt/qwen3-8b-l4/config.json" ] || python3 tools/make_random_checkpoint.py qwen3-8b "$ckpt/qwen3-8b-l4" --layers 4 --seed 1
  ids=$(python3 -c "import random; r = random.Random(5); print(','.join(str(r.randrange(151936)) for _ in range(200)))")
  python3 tools/logits_rounding_sites.py "$ckpt/qwen3-8b-l4" --prompt-ids "$ids" --json "$out/logits_rounding_sites.json" ||
    status=1
fi

if [[ " $steps " == *" bench "* ]]; then
  echo "== bench-step: Qwen3-8B shape + z-lab DFlash draft shape, random weights =="
  random_8b_pair
  "$dflash" bench-step --device cuda --model "$ckpt/qwen3-8b" --draft "$ckpt/dflash-8b" \
    --batch "${BENCH_BATCH:-1,8,32}" --context "${BENCH_CONTEXT:-512,2048}" --json "$out/bench_step.json" \
    ${BENCH_PREFILL:+--prefill "$BENCH_PREFILL" --prefill-batch "${BENCH_PREFILL_BATCH:-1}"} \
    2>&1 | tee "$out/bench_step.txt" || status=1
fi
if [[ $steps == *profile* ]]; then
  # Per-kernel GPU time of the batch-1 step graphs at context 512 (plain, draft, verify), from
  # CUPTI through tools/kernel_trace.
  echo "== profile: bench-step batch 1, context 512, every graph node traced =="
  # PROFILE_MODEL=moe: the 30B-A3B-shaped MoE pair instead of the 8B-shaped one.
  if [ "${PROFILE_MODEL:-8b}" = moe ]; then
    random_moe_pair
    target="$ckpt/qwen3-30b-a3b" draft="$ckpt/dflash-30b-a3b"
  else
    random_8b_pair
    target="$ckpt/qwen3-8b" draft="$ckpt/dflash-8b"
  fi
  # Variants: PROFILE="name=ENV ..." entries separated by ';' (default: one run named pdl, no
  # extra environment, e.g. PROFILE="pdl=DFLASH_TRACE_NODES=400").
  IFS=';' read -ra variants <<< "${PROFILE:-pdl=}"
  for v in "${variants[@]}"; do
    name=${v%%=*}
    env ${v#*=} CUDA_INJECTION64_PATH="$PWD/build-dev/lib/libdflash_kernel_trace.so" \
      DFLASH_TRACE_OUT="$out/profile_$name.txt" "$dflash" bench-step --device cuda --model "$target" \
      --draft "$draft" --batch "${PROFILE_BATCH:-1}" --context 512 --iters 20 --warmup 3 --skip-kernels \
      --leak-check-steps 0 > "$out/profile_run_$name.txt" 2>&1 || status=1
  done
  # The same rows untraced.
  "$dflash" bench-step --device cuda --model "$target" --draft "$draft" \
    --batch 1,32 --context 512 --skip-kernels --leak-check-steps 0 2>&1 | tee "$out/bench_step_untraced.txt" || status=1
fi

if [[ $steps == *bench-moe* ]]; then
  echo "== bench-step: Qwen3-30B-A3B shape + a dense DFlash draft, random weights (uniform routing) =="
  random_moe_pair
  "$dflash" bench-step --device cuda --model "$ckpt/qwen3-30b-a3b" --draft "$ckpt/dflash-30b-a3b" \
    --batch "${BENCH_BATCH:-1,8,32}" --context "${BENCH_CONTEXT:-512}" --json "$out/bench_step_moe.json" \
    ${BENCH_PREFILL:+--prefill "$BENCH_PREFILL" --prefill-batch "${BENCH_PREFILL_BATCH:-1}"} \
    2>&1 | tee "$out/bench_step_moe.txt" || status=1
fi

if [[ $steps == *bench-qwen3_5* ]]; then
  echo "== bench-step: Qwen3.5-27B shape + a DFlash draft, random weights =="
  random_qwen3_5_pair
  "$dflash" bench-step --device cuda --model "$ckpt/qwen3_5-27b" --draft "$ckpt/dflash-qwen3_5-27b" \
    --batch "${BENCH_BATCH:-1,8,32}" --context "${BENCH_CONTEXT:-512}" --json "$out/bench_step_qwen3_5.json" \
    ${BENCH_PREFILL:+--prefill "$BENCH_PREFILL" --prefill-batch "${BENCH_PREFILL_BATCH:-1}"} \
    2>&1 | tee "$out/bench_step_qwen3_5.txt" || status=1
fi

if [[ " $steps " == *" tp "* ]]; then
  # Tensor parallelism (a kind with TP GPUs, default 2): the GPU tests of tensor parallelism, then
  # bench-step of the 8B-shaped pair at TP 1 and TP (all-reduce rows among the kernels).
  tp=${TP:-2}
  echo "== tensor parallelism over $tp GPUs =="
  nvidia-smi topo -m 2>&1 | tee "$out/topology.txt" || true
  with_libs build-dev/tests/dflash_tests --gtest_filter='CudaTensorParallel*' 2>&1 | tee "$out/tests_tp.txt" || status=1
  random_8b_pair
  for n in 1 "$tp"; do
    "$dflash" bench-step --device cuda --tensor-parallel "$n" --model "$ckpt/qwen3-8b" --draft "$ckpt/dflash-8b" \
      --batch "${BENCH_BATCH:-1,8,32}" --context "${BENCH_CONTEXT:-512}" --leak-check-steps 0 \
      --json "$out/bench_step_tp$n.json" 2>&1 | tee "$out/bench_step_tp$n.txt" || status=1
  done
fi
if [[ " $steps " == *" serving-tp "* ]]; then
  # The serving sweep at TP 1 and TP (default 2) of the 8B-shaped pair, or with SERVE_TP_MODEL=moe
  # of the 30B-A3B-shaped pair.
  tp=${TP:-2}
  if [ "${SERVE_TP_MODEL:-8b}" = moe ]; then
    random_moe_pair
    target=qwen3-30b-a3b draft=dflash-30b-a3b
  else
    random_8b_pair
    target=qwen3-8b draft=dflash-8b
  fi
  add_tokenizer "$ckpt/$target"
  for n in 1 "$tp"; do
    echo "== serving sweep, $target-shaped pair, tensor parallel $n =="
    python3 tools/bench_serving.py --dflash "$dflash" --n "${SERVE_N:-32}" --concurrency "${SERVE_CONC:-1,8,32}" \
      --max-tokens 128 \
      --server-args "--device cuda --tensor-parallel $n --model $ckpt/$target --draft $ckpt/$draft --gpu-memory-fraction 0.9" \
      --json "$out/serving_gpu_$target-shape_tp$n.json" 2>&1 | tee "$out/serving_gpu_$target-shape_tp$n.txt" || status=1
  done
fi

if [[ " $steps " == *" ncu "* ]]; then
  # Nsight Compute on two 16-row verification attention launches of batch 32 at context 512 (the
  # launches after the plain rows and the draft; at this size the kernel runs a tile's splits in a
  # loop): bench/results/ncu_h100_attention_b32_verify.txt.
  random_8b_pair
  with_libs ncu --clock-control none -k regex:attention_mma --launch-skip 150 \
    --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section LaunchStats --section SchedulerStats \
    build-dev/dflash bench-step --device cuda --model "$ckpt/qwen3-8b" --draft "$ckpt/dflash-8b" --batch 32 \
    --context 512 --iters 1 --warmup 1 --skip-kernels --leak-check-steps 0 > "$out/ncu_b32_verify.txt" 2>&1 || status=1
fi

if [[ " $steps " == *" ncu-decode "* ]]; then
  # Nsight Compute (--set full) on one batch-1 decode attention launch at context 512 (the 41st:
  # inside the plain rows), with its per-instruction SASS counters:
  # bench/results/ncu_h100_attention_b1_decode.txt.
  random_8b_pair
  with_libs ncu --clock-control none --set full --import-source no -k regex:attention_mma --launch-skip 40 \
    --launch-count 1 -o "$out/ncu_decode" build-dev/dflash bench-step --device cuda --model "$ckpt/qwen3-8b" \
    --draft "$ckpt/dflash-8b" --batch 1 --context 512 --iters 1 --warmup 1 --skip-kernels --leak-check-steps 0 \
    > "$out/ncu_decode_run.txt" 2>&1 || status=1
  ncu -i "$out/ncu_decode.ncu-rep" --print-details all > "$out/ncu_decode.txt" 2>&1 || status=1
  ncu -i "$out/ncu_decode.ncu-rep" --page source --csv --print-source sass > "$out/ncu_decode_sass.csv" 2>&1 || status=1
fi

if [[ " $steps " == *" ncu-moe-b1 "* ]]; then
  # Nsight Compute (--set full) on one launch of each launch configuration of the kernels NCU_REGEX
  # matches (default: the decode attention and its split combine) at batch 1 (NCU_BATCH) on 12 layers
  # of the 30B-A3B shape, context 512: the plain step's (one row) and the DFlash step's (16 rows of the
  # draft block and of the verification), with per-instruction SASS counters, read by
  # tools/ncu_summary.py into ncu_moe_b1_summary.txt: bench/results/ncu_h200_attention_b1_moe.txt. NCU_HOT=N
  # adds each kernel's instructions executed N times a warp or more (its loop bodies: ncu_summary.py --hot).
  random_moe12_pair
  with_libs ncu --clock-control none --set full --metrics dram__bytes_read.sum --import-source no --filter-mode per-launch-config \
    -k regex:"${NCU_REGEX:-attention_mma|combine_kernel}" --launch-count 1 -o "$out/ncu_moe_b1" build-dev/dflash bench-step \
    --device cuda --model "$ckpt/qwen3-30b-a3b-12l" --draft "$ckpt/dflash-30b-a3b-12l" --batch "${NCU_BATCH:-1}" --context 512 \
    --iters 1 --warmup 1 --skip-kernels --leak-check-steps 0 > "$out/ncu_moe_b1_run.txt" 2>&1 || status=1
  ncu -i "$out/ncu_moe_b1.ncu-rep" --print-details all > "$out/ncu_moe_b1.txt" 2>&1 || status=1
  ncu -i "$out/ncu_moe_b1.ncu-rep" --page source --csv --print-source sass > "$out/ncu_moe_b1_sass.csv" 2>&1 || status=1
  python3 tools/ncu_summary.py "$out/ncu_moe_b1.txt" "$out/ncu_moe_b1_sass.csv" --hot "${NCU_HOT:-0}" \
    > "$out/ncu_moe_b1_summary.txt" 2>&1 ||
    status=1
fi

if [[ " $steps " == *" ncu-sectors "* ]]; then
  # Per instruction, the L2 sectors each global access touches against the ideal for its bytes
  # (Nsight Compute's source counters, tools/ncu_sectors.py), for the kernels NCU_KERNEL matches (a
  # regex over mangled names; default: the 16-row routed SwiGLU product and its dense sibling, the
  # draft's) at batch NCU_BATCH of the 12-layer 30B-A3B shape's bench-step:
  # bench/results/ncu_h100_moe_routed_smem_offset.txt.
  random_moe12_pair
  with_libs ncu --clock-control none --kernel-name-base mangled \
    -k "regex:${NCU_KERNEL:-skinny_gemm_kernelILi2ELi2ELb1ELb0EtLb0ELb[01]E}" --launch-skip "${NCU_SKIP:-10}" \
    --launch-count "${NCU_COUNT:-2}" --section SourceCounters --page source --print-source sass --csv \
    build-dev/dflash bench-step --device cuda --model "$ckpt/qwen3-30b-a3b-12l" --draft "$ckpt/dflash-30b-a3b-12l" \
    --batch "${NCU_BATCH:-1}" --context 512 --iters 2 --warmup 1 --skip-kernels --leak-check-steps 0 \
    > "$out/ncu_sectors.csv" 2>&1 || status=1
  python3 tools/ncu_sectors.py "$out/ncu_sectors.csv" 2>&1 | tee "$out/ncu_sectors.txt" || status=1
fi

if [[ " $steps " == *" ab "* ]]; then
  # A/B timing of environment settings, one bench-step run per entry of AB (';'-separated; an
  # empty entry runs the defaults), e.g. AB=";NAME=VALUE" for a temporary switch under test (the
  # kernels read no environment variables; code changes without a switch: STEPS=builds).
  random_8b_pair
  IFS=';' read -ra variants <<< "${AB:-;}"
  for i in "${!variants[@]}"; do
    echo "== A/B $i: ${variants[$i]:-defaults} =="
    env ${variants[$i]} "$dflash" bench-step --device cuda --model "$ckpt/qwen3-8b" --draft "$ckpt/dflash-8b" \
      --batch "${BENCH_BATCH:-1,8,32}" --context "${BENCH_CONTEXT:-512}" --skip-kernels --leak-check-steps 0 2>&1 |
      tee "$out/ab_$i.txt" || status=1
  done
fi

if [[ " $steps " == *" builds "* ]]; then
  # A/B of two builds (pack-builds): bench-step with the baseline binary, then with this build,
  # alternating for ROUNDS rounds (default 2), on the 8B-shaped pair or (BUILDS_MODEL=moe12) the
  # 12-layer 30B-A3B-shaped one.
  if [ "${BUILDS_MODEL:-8b}" = moe12 ]; then
    random_moe12_pair
    pair=(--model "$ckpt/qwen3-30b-a3b-12l" --draft "$ckpt/dflash-30b-a3b-12l")
  else
    random_8b_pair
    pair=(--model "$ckpt/qwen3-8b" --draft "$ckpt/dflash-8b")
  fi
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s:%s:$LD_LIBRARY_PATH" exec "%s" "$@"\n' "$PWD/base/build-dev/lib" \
    "$PWD/build-dev/lib" "$PWD/base/build-dev/dflash" > build-dev/dflash-base-run
  chmod +x build-dev/dflash-base-run
  for round in $(seq "${ROUNDS:-2}"); do
    for build in base new; do
      echo "== round $round: $build =="
      bin=$dflash; [ $build = base ] && bin=build-dev/dflash-base-run
      "$bin" bench-step --device cuda "${pair[@]}" \
        --batch "${BENCH_BATCH:-1,8,32}" --context "${BENCH_CONTEXT:-512}" --skip-kernels --leak-check-steps 0 2>&1 |
        tee -a "$out/builds_$build.txt" || status=1
    done
  done
fi

if [[ $steps == *serving-moe* ]]; then
  echo "== serving sweep on the GPU: the 30B-A3B-shaped pair =="
  random_moe_pair
  add_tokenizer "$ckpt/qwen3-30b-a3b"
  python3 tools/bench_serving.py --dflash "$dflash" --n "${SERVE_N:-32}" --concurrency "${SERVE_CONC:-1,8,32}" \
    --max-tokens 128 \
    --server-args "--device cuda --model $ckpt/qwen3-30b-a3b --draft $ckpt/dflash-30b-a3b --gpu-memory-fraction 0.9" \
    --json "$out/serving_gpu_qwen3-30b-a3b-shape.json" 2>&1 | tee "$out/serving_gpu_qwen3-30b-a3b-shape.txt" || status=1
fi
if [[ " $steps " == *" serving "* ]]; then
  # Step times with the 8B-shaped random pair (the Qwen3 tokenizer from the test fixtures; its
  # random drafts are never accepted), tau with the bundled pair.
  echo "== serving sweeps on the GPU =="
  random_8b_pair
  add_tokenizer "$ckpt/qwen3-8b"
  # The KV cache takes 0.9 of the memory left after the weights (--gpu-memory-fraction on a GPU).
  python3 tools/bench_serving.py --dflash "$dflash" --n "${SERVE_N:-32}" --concurrency "${SERVE_CONC:-1,8,32}" \
    --max-tokens 128 \
    --server-args "--device cuda --model $ckpt/qwen3-8b --draft $ckpt/dflash-8b --gpu-memory-fraction 0.9" \
    --json "$out/serving_gpu_qwen3-8b-shape.json" 2>&1 | tee "$out/serving_gpu_qwen3-8b-shape.txt" || status=1
  python3 tools/bench_serving.py --dflash "$dflash" --n "${SERVE_N:-32}" --concurrency "${SERVE_CONC:-1,8,32}" \
    --max-tokens 128 --server-args "--device cuda" \
    --json "$out/serving_gpu_bundled.json" 2>&1 | tee "$out/serving_gpu_bundled.txt" || status=1
fi
if [[ $steps == *ttft* ]]; then
  # Time to first token of a fresh server, the first request against later ones (8B-shaped
  # random pair, DFlash serving; prompts of random token ids, a new one each request).
  echo "== time to first token: first request and later ones =="
  random_8b_pair
  add_tokenizer "$ckpt/qwen3-8b"
  python3 tools/bench_ttft.py --dflash "$dflash" --prompt-tokens "${TTFT_PROMPTS:-512,700,1000,1500,4096}" --requests 5 \
    --server-args "--device cuda --model $ckpt/qwen3-8b --draft $ckpt/dflash-8b --gpu-memory-fraction 0.9" \
    --json "$out/ttft_qwen3-8b-shape.json" 2>&1 | tee "$out/ttft_qwen3-8b-shape.txt" || status=1
fi
if [[ $steps == *sampling* ]]; then
  # Sampled generation (temperature 0.6, top-k 20, top-p 0.95: Qwen3's generation_config), the
  # top-k candidates selected on the GPU: per-step times from `generate --json`, 8B-shaped random
  # pair (drafts never accepted) and the bundled pair.
  echo "== sampled generation =="
  random_8b_pair
  ids=$(python3 -c "import random; r = random.Random(9); print(','.join(str(r.randrange(151669)) for _ in range(64)))")
  sample="--temperature 0.6 --top-k 20 --top-p 0.95 --seed 7 --json"
  : > "$out/sampling_gpu.txt"
  for mode in "none match" "dflash match" "dflash rejection"; do
    read -r spec scheme <<< "$mode"
    echo "8b-shape speculative=$spec scheme=$scheme: $("$dflash" generate \
      --device cuda --model "$ckpt/qwen3-8b" --draft "$ckpt/dflash-8b" --speculative "$spec" --spec-sampling "$scheme" \
      --prompt-ids "$ids" --max-tokens 128 $sample | python3 tools/generate_stats.py)" | tee -a "$out/sampling_gpu.txt" ||
      status=1
    echo "bundled speculative=$spec scheme=$scheme: $("$dflash" generate \
      --device cuda --speculative "$spec" --spec-sampling "$scheme" --prompt "def quicksort(items):" --max-tokens 256 \
      $sample | python3 tools/generate_stats.py)" | tee -a "$out/sampling_gpu.txt" || status=1
  done
fi
if [[ " $steps " == *" graphs "* ]]; then
  # Greedy `generate --json` with the decoding forwards replayed as CUDA graphs (the default) and
  # launched op by op (--no-graphs): 8B-shaped random pair (drafts never accepted) and the
  # bundled pair.
  echo "== generate: CUDA-graph replays against op-by-op launches =="
  random_8b_pair
  ids=$(python3 -c "import random; r = random.Random(9); print(','.join(str(r.randrange(151669)) for _ in range(512)))")
  : > "$out/generate_graphs_gpu.txt"
  for run in 1 2; do
    for graphs in 1 0; do
      for spec in none dflash; do
        nog=""; [ $graphs = 0 ] && nog=--no-graphs
        echo "8b-shape speculative=$spec graphs=$graphs: $("$dflash" generate --device cuda $nog \
          --model "$ckpt/qwen3-8b" --draft "$ckpt/dflash-8b" --speculative "$spec" --prompt-ids "$ids" \
          --max-tokens 256 --ignore-eos --json | python3 tools/generate_stats.py)" | tee -a "$out/generate_graphs_gpu.txt" ||
          status=1
        echo "bundled speculative=$spec graphs=$graphs: $("$dflash" generate --device cuda $nog \
          --speculative "$spec" --prompt "def quicksort(items):" --max-tokens 512 --ignore-eos --json |
          python3 tools/generate_stats.py)" | tee -a "$out/generate_graphs_gpu.txt" || status=1
      done
    done
  done
fi
exit $status
