#!/usr/bin/env bash
# On a machine with Hugging Face `tokenizers` (the device): writes the golden
# ids the tokenizer parity tests use and compares encode speed with HF.
# Usage: bash scripts/tokenizer-device.sh CORPUS.jsonl BENCH_CORPUS.jsonl DFLASH_BINARY OUTDIR
set -euo pipefail
corpus=$1 bench=$2 dflash=$3 out=$4
work=$(mktemp -d)
tar -xJf tests/fixtures/tokenizers/qwen3.tar.xz -C "$work"
python3 -c "import tokenizers; print('tokenizers', tokenizers.__version__)" | tee "$out/versions.txt"
python3 tools/tokenizer_golden.py --tokenizer "$work/qwen3" --corpus "$corpus" --out "$work/qwen3_golden.jsonl"
python3 tools/make_test_tokenizers.py --corpus "$corpus" --out "$work"
for t in llama3_style gpt2_style; do
  python3 tools/tokenizer_golden.py --tokenizer "$work/$t" --corpus "$corpus" --out "$work/${t}_golden.jsonl" \
    --every 4 --with-special
  cp "$work/$t/tokenizer.json" "$out/$t.tokenizer.json"
done
for f in qwen3_golden llama3_style_golden gpt2_style_golden; do xz -T8 -9 -c "$work/$f.jsonl" > "$out/$f.jsonl.xz"; done
# Speed: one thread each, same strings, alternated twice.
lscpu | grep -m1 'Model name' | tee -a "$out/versions.txt"
for i in 1 2; do
  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python3 tools/bench_tokenizer_hf.py --tokenizer "$work/qwen3" \
    --corpus "$bench" | sed 's/^/hf /' | tee -a "$out/bench.txt"
  "$dflash" tokenize --tokenizer "$work/qwen3" --bench "$bench" | sed 's/^/dflash /' | tee -a "$out/bench.txt"
done
# Added-token flags (lstrip, rstrip, single_word, normalized) on purpose-built strings, with the
# tokenizers shipped in tokenizer_golden.tar.xz.
tar -xJf tests/fixtures/tokenizers/tokenizer_golden.tar.xz -C "$work"
for t in llama3_style gpt2_style; do
  python3 tools/tokenizer_golden.py --tokenizer "$work/tokenizer_golden/$t" --corpus tests/fixtures/tokenizers/added_tokens_cases.jsonl \
    --out "$out/${t}_added.jsonl" --with-special
done
