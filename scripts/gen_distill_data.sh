#!/usr/bin/env bash
# Self-distillation data for the demo model, in the background; rerun the same command to resume
# (every step skips what it already stored). Three data directories, trained on together:
#   1. $OUT_BASE-greedy:        greedy answers to every prompt of train.jsonl
#   2. $OUT_BASE-t0.7:          16 sampled answers (temperature 0.7) per Self-Instruct seed prompt:
#                               train.jsonl has only 175 open-ended tasks against ~14k maths and code ones
#   3. $OUT_BASE-self-instruct: greedy answers to 4,500 new tasks the target wrote itself in the
#                               style of those seeds (`selfspec synth-prompts`)
#   scripts/gen_distill_data.sh [EXTRA FLAGS for gen-data...]      e.g. --batch-size 32
# Env: MODEL (smollm2-135m), PROMPTS (required: the maths/code/self-instruct training prompt file, JSONL;
#      never training/prompts/dev.jsonl),
#      OUT_BASE (training/data/$MODEL), LOG (/tmp/gen_data.log), THREADS (2), DTYPE (bfloat16).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m}
PROMPTS=${PROMPTS:?set PROMPTS to the training prompt file (JSONL with a "prompt" per line)}
OUT_BASE=${OUT_BASE:-training/data/$MODEL}
LOG=${LOG:-/tmp/gen_data.log}
THREADS=${THREADS:-2}
DTYPE=${DTYPE:-bfloat16}
SYNTH=training/prompts/$MODEL-self-instruct.jsonl
case "$PROMPTS" in *dev.jsonl) echo "refusing to generate training data from dev prompts: $PROMPTS" >&2; exit 2;; esac
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
COMMON=(--model "$MODEL" --max-new-tokens 128 --batch-size 128 --threads "$THREADS" --dtype "$DTYPE" --no-progress)
nohup bash -c '
set -euo pipefail
python -m selfspec.training.data "$@" --prompts "'"$PROMPTS"'" --out "'"$OUT_BASE"'-greedy" --temperature 0
python -m selfspec.training.data "$@" --prompts "'"$PROMPTS"'" --out "'"$OUT_BASE"'-t0.7" \
    --sources self_instruct_seed --samples 16 --temperature 0.7 --seed 1
for n in 1500 4500; do  # in two rounds, as the shipped data was made (rows 1-1,500 trained stage 1)
    selfspec synth-prompts --model "'"$MODEL"'" --seeds "'"$PROMPTS"'" --sources self_instruct_seed --n $n \
        --max-new-tokens 48 --batch-size 64 --threads "'"$THREADS"'" --dtype "'"$DTYPE"'" --out "'"$SYNTH"'" --no-progress
    python -m selfspec.training.data "$@" --prompts "'"$SYNTH"'" --out "'"$OUT_BASE"'-self-instruct" --temperature 0
done
' gen-data "${COMMON[@]}" "$@" >>"$LOG" 2>&1 &
echo "started pid $! -> $OUT_BASE-{greedy,t0.7,self-instruct} (log: $LOG)"
