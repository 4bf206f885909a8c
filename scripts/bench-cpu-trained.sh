#!/usr/bin/env bash
# Plain vs DFlash greedy on the trained fixture pair, one prompt, CPU.
# Usage: bash scripts/bench-cpu-trained.sh [prompt index] [max tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
idx=${1:-3}
n=${2:-400}
ids=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open('tests/fixtures/expected/trained_qwen3.json'))['prompts'][$idx])))")
for mode in none dflash; do
  build/dflash generate --model tests/fixtures/targets/trained_qwen3 --draft tests/fixtures/drafts/trained_qwen3_b16 \
      --speculative "$mode" --prompt-ids "$ids" --max-tokens "$n" --json |
    python3 -c "import json,sys; j=json.load(sys.stdin); t=j['timings_ms']; print('$mode: %d tokens, %d steps, tau %.2f, %.0f tok/s (total %.1f ms: prefill %.1f, draft %.1f, verify %.1f)' % (len(j['tokens']), j['n_steps'], j['tau'], len(j['tokens']) / t['total'] * 1000, t['total'], t['prefill'], t['draft'], t['verify']))"
done
