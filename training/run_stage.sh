#!/usr/bin/env bash
# One device call of the training pipeline. Each stage rebuilds the corpus from
# the machine's Python files (deterministic), then:
#   target: trains the tokenizer and pretrains the target;
#   target-continue: continues pretraining the target in $TARGET_DIR (fresh schedule, lr $LR);
#   draft-continue: continues training the draft in $DRAFT_DIR;
#   draft:  trains the DFlash draft for the target in $TARGET_DIR (a previous stage's output).
# Outputs go to $OUT (at most 8 files of 16 MB): safetensors shards as they are,
# everything else in one tar.
# Usage: bash training/run_stage.sh target|draft MINUTES
set -euo pipefail
cd "$(dirname "$0")"
stage=$1 minutes=$2
work=/tmp/dflash-train
mkdir -p "$work" "$OUT"
roots=$(python3 -c "import site, sysconfig; print(' '.join(sorted(set(site.getsitepackages() + [sysconfig.get_paths()['stdlib']]))))")
[ -f "$work/corpus/manifest.json" ] || python3 corpus.py --out "$work/corpus" --max-mb 300 $roots | tee "$OUT/corpus.log"
case "$stage" in
  target)
    python3 tokenizer.py --corpus "$work/corpus" --out "$work/tokenizer"
    python3 pretrain.py --corpus "$work/corpus" --tokenizer "$work/tokenizer" --out "$work/target" \
      --report "$work/pretrain_report.json" --minutes "$minutes"
    mv "$work"/target/model-*.safetensors "$OUT/"
    tar -C "$work" -cf "$OUT/target_rest.tar" target corpus/manifest.json pretrain_report.json
    ;;
  target-continue)
    python3 pretrain.py --corpus "$work/corpus" --tokenizer "$TARGET_DIR" --init "$TARGET_DIR" --out "$work/target" \
      --report "$work/pretrain_report.json" --minutes "$minutes" --lr "${LR:-1e-3}"
    mv "$work"/target/model-*.safetensors "$OUT/"
    tar -C "$work" -cf "$OUT/target_rest.tar" target corpus/manifest.json pretrain_report.json
    ;;
  draft-continue)
    # Writes straight into $OUT so that the draft comes back even if evaluation runs out of time.
    python3 draft.py --corpus "$work/corpus" --target "$TARGET_DIR" --init "$DRAFT_DIR" --out "$OUT/draft" \
      --report "$OUT/draft_report.json" --humaneval ../bench/data/humaneval.jsonl --minutes "$minutes" \
      --gen-minutes "${GEN_MINUTES:-1.0}" --lr "${LR:-1e-3}" --seed "${SEED:-2}"
    rm -rf "$OUT/draft-smoke"
    ;;
  draft)
    python3 draft.py --corpus "$work/corpus" --target "$TARGET_DIR" --out "$work/draft" \
      --report "$work/draft_report.json" --humaneval ../bench/data/humaneval.jsonl --minutes "$minutes"
    tar -C "$work" -cf "$OUT/draft.tar" draft draft_report.json
    ;;
esac
ls -la "$OUT"
