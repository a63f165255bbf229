#!/usr/bin/env bash
# Self-distillation data for the demo model, in the background; rerun the same command to resume.
#   scripts/gen_distill_data.sh [EXTRA FLAGS...]      e.g. --batch-size 32 --max-prompts 1000
# Env: MODEL (smollm2-135m), PROMPTS (../shared/data/prompts/train.jsonl; never the dev prompts),
#      OUT (training/data/$MODEL-greedy), LOG (/tmp/gen_data.log), THREADS (1).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m}
PROMPTS=${PROMPTS:-../shared/data/prompts/train.jsonl}
OUT=${OUT:-training/data/$MODEL-greedy}
LOG=${LOG:-/tmp/gen_data.log}
THREADS=${THREADS:-1}
case "$PROMPTS" in *dev.jsonl) echo "refusing to generate training data from dev prompts: $PROMPTS" >&2; exit 2;; esac
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
nohup python -m selfspec.training.data --model "$MODEL" --prompts "$PROMPTS" --out "$OUT" \
    --temperature 0 --max-new-tokens 128 --threads "$THREADS" "$@" >>"$LOG" 2>&1 &
echo "started pid $! -> $OUT (log: $LOG)"
