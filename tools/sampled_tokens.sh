#!/usr/bin/env bash
# Prints the tokens `dflash generate` samples for plain, match and rejection decoding under four
# (temperature, top_k, top_p) settings, one line per run, so that two builds can be compared
# token for token (a change to token choice must leave these unchanged):
#   bash tools/sampled_tokens.sh [DFLASH_BINARY] [generate options...] > tokens.txt
set -euo pipefail
dflash=${1:-build/dflash}
shift || true
for mode in "none match" "dflash match" "dflash rejection"; do
  read -r spec scheme <<< "$mode"
  for setting in "0.6 20 0.95" "1.0 0 0.9" "1.3 50 1.0" "0.8 0 1.0"; do
    read -r t k p <<< "$setting"
    "$dflash" generate --speculative "$spec" --spec-sampling "$scheme" --prompt "def quicksort(items):" \
      --max-tokens 48 --temperature "$t" --top-k "$k" --top-p "$p" --seed 11 --json "$@" |
      python3 -c "import json, sys; print(json.load(sys.stdin)['tokens'])"
  done
done
