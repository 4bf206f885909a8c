#!/usr/bin/env bash
# Builds the libFuzzer targets with clang, ASan and UBSan, and runs each one for
# RUNS executions (default 1,000,000) from the seed corpora in fuzz/corpus/.
# New inputs found go to build-fuzz/corpus/, never into the repository; inputs
# that crash go to build-fuzz/artifacts/.
# Usage: bash scripts/fuzz.sh [RUNS] [target ...]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1000000}
shift || true
if (($#)); then targets=("$@"); else targets=(tokenizer_load tokenizer_encode chat_template request safetensors model_config); fi
missing=()
for p in clang libclang-rt-dev xz-utils; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
cmake -S . -B build-fuzz -DDFLASH_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDFLASH_NATIVE=OFF -DDFLASH_SANITIZE=ON >/dev/null
cmake --build build-fuzz -j "$(nproc)"
tar -xJf tests/fixtures/tokenizers/qwen3.tar.xz -C build-fuzz
export DFLASH_FUZZ_TOKENIZER=$PWD/build-fuzz/qwen3
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
for t in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$t" build-fuzz/artifacts
  echo "== fuzz_$t: $runs runs"
  "build-fuzz/fuzz/fuzz_$t" -runs="$runs" -max_len=8192 -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 \
    -artifact_prefix=build-fuzz/artifacts/"$t"- \
    "build-fuzz/corpus/$t" "fuzz/corpus/$t" 2>&1 | tail -n 12
done
