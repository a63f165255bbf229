#!/usr/bin/env bash
# The EAGLE head for a GPU lease of fixed length: the target answers broad prompts (self-distillation,
# greedy, bfloat16) for GEN seconds, then the head is trained for TRAIN seconds on those answers and the
# committed ones (from scratch, or warm-started with --init). The step count is planned from a 10-step
# timing run, so the cosine schedule ends on time. Everything resumes: rerun with the same --out to add
# answers (stored prompts are skipped); the training run writes atomic checkpoints. The head keeps the
# decode settings (tree, threshold, lookup) of the shipped EAGLE head until `selfspec tune-tree` reruns.
#
#   scripts/gpu_train_eagle.sh --prompts FILE --out DIR [--gen-seconds 150] [--train-seconds 200]
#                              [--data LIST] [--init DIR] [--batch-size 32] [--gen-batch 384] [--gen-static]
#                              [--device cuda]
#
#   --prompts FILE       JSONL prompts to answer (id, prompt): e.g. the broad set, shuffled once
#   --out DIR            DIR/data: the new answers; DIR/heads: the trained head (DIR/cal: the timing run)
#   --data LIST          more gen-data directories to train on (comma list; DIR@N takes its first N rows);
#                        default: the committed self-distillation data of the demo model. Prompts that any of
#                        them already answers are not answered again (gen-data --skip-stored)
#   --init DIR           heads to warm-start from (default: none, from scratch; a warm start needs the data the
#                        init was trained on, to keep its held-out split held out)
#   --gen-static         answer with `gen-data --static-cache` (one shape for every batch, compiled once by
#                        transformers: CUDA graphs; prompts in file order), by default in one call for the
#                        whole file (one compilation); if that call fails, the run goes on without it
# Env: MODEL (smollm2-135m), CHUNK (prompts per gen-data call, 6144: each call answers its chunk longest
# first, so chunks keep a stopped run's answers a fair sample; with --gen-static, the whole file), STEPS_MIN (20),
# TRAIN_ARGS (more train-heads flags).
set -euo pipefail
cd "$(dirname "$0")/.."

PROMPTS="" OUT="" GEN_S=150 TRAIN_S=200 INIT="" BATCH=32 GEN_BATCH=384 DEVICE=cuda STATIC=()
D=training/data/smollm2-135m
DATA=$D-greedy,$D-t0.7,$D-self-instruct,$D-broad-self,$D-broad-gpu,$D-broad-cpu
while [ $# -gt 0 ]; do
    case "$1" in
        --prompts) PROMPTS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --gen-seconds) GEN_S="$2"; shift 2 ;;
        --train-seconds) TRAIN_S="$2"; shift 2 ;;
        --data) DATA="$2"; shift 2 ;;
        --init) INIT="$2"; shift 2 ;;
        --batch-size) BATCH="$2"; shift 2 ;;
        --gen-batch) GEN_BATCH="$2"; shift 2 ;;
        --gen-static) STATIC=(--static-cache); shift ;;
        --device) DEVICE="$2"; shift 2 ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu_train_eagle: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -n "$PROMPTS" ] && [ -f "$PROMPTS" ] || { echo "gpu_train_eagle: --prompts FILE is required (got '${PROMPTS}')" >&2; exit 2; }
[ -n "$OUT" ] || { echo "gpu_train_eagle: --out DIR is required" >&2; exit 2; }
for n in "$GEN_S" "$TRAIN_S" "$BATCH" "$GEN_BATCH"; do
    [[ "$n" =~ ^[0-9]+$ ]] || { echo "gpu_train_eagle: seconds and batch sizes are whole numbers (got $n)" >&2; exit 2; }
done
MODEL=${MODEL:-smollm2-135m}
total=$(grep -c . "$PROMPTS")
DYNAMIC_CHUNK=6144
if [ "${#STATIC[@]}" -gt 0 ]; then CHUNK=${CHUNK:-$total}; else CHUNK=${CHUNK:-$DYNAMIC_CHUNK}; fi
STEPS_MIN=${STEPS_MIN:-20}
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DECODE_FROM=$("$PY" -c "from selfspec.shipped import shipped_heads; print(shipped_heads('$MODEL', 'eagle') or '')")
mkdir -p "$OUT"
now() { date +%s; }

echo "== answers: $PROMPTS -> $OUT/data for ${GEN_S} s ($(date -u +%H:%M:%S))"
deadline=$(( $(now) + GEN_S ))
for ((n = CHUNK; ; n += CHUNK)); do
    left=$(( deadline - $(now) ))
    [ "$left" -gt 10 ] || break
    # SIGINT at the deadline: the shard being written is dropped whole, every finished one stays
    rc=0
    timeout -s INT "$left" "$PY" -m selfspec gen-data --model "$MODEL" --prompts "$PROMPTS" --out "$OUT/data" \
        --max-prompts "$n" --max-new-tokens 160 --max-prompt-tokens 384 --batch-size "$GEN_BATCH" --shard-size 1 \
        --dtype bfloat16 --device "$DEVICE" --skip-stored "$DATA" --no-progress "${STATIC[@]}" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "${#STATIC[@]}" -gt 0 ]; then
        echo "== gen-data --static-cache failed (exit $rc): answering the rest without it"
        STATIC=()
        CHUNK=$DYNAMIC_CHUNK; n=0      # on as without it, from the first prompt not yet answered
        continue
    fi
    [ "$n" -ge "$total" ] && break
done
ls "$OUT/data"/shard-* >/dev/null 2>&1 || { echo "gpu_train_eagle: no answers were stored in $OUT/data" >&2; exit 1; }
ALL="$DATA,$OUT/data"

START=(--lr 5e-4 --warmup 50)
[ -n "$INIT" ] && START=(--init "$INIT" --lr 3e-4 --warmup 20)
# shellcheck disable=SC2206
COMMON=(--model "$MODEL" --kind eagle "${START[@]}" --data "$ALL" --loss-rows response --aux-layers 2,15,27
        --ttt-steps 4 --max-len 512 --batch-size "$BATCH" --draft-vocab-size 8192 --group-by-length true
        --eval-fraction 0.004 --device "$DEVICE" --no-progress ${TRAIN_ARGS:-})
echo "== timing run: 10 steps ($(date -u +%H:%M:%S))"
t0=$(now)
line=$("$PY" -m selfspec train-heads "${COMMON[@]}" --steps 10 --eval-every 1000 --save-every 1000 --out "$OUT/cal" | tail -1)
echo "$line"
rm -rf "$OUT/cal"
wall=$("$PY" -c "import re, sys; print(re.search(r' in ([0-9.]+) s ', sys.argv[1]).group(1))" "$line")
left=$(( TRAIN_S - ($(now) - t0) - 25 ))     # 25 s: loading the model and data again, the final eval and save
# 0.9: batches are grouped by length (train-heads --group-by-length), so 10 of them time the mean step
# only roughly; a run that ends a little early beats one the lease cuts off
steps=$("$PY" -c "print(max($STEPS_MIN, int(0.9 * $left / ($wall / 10))))")
echo "== training: $steps steps (${wall} s per 10 steps, $left s left) ($(date -u +%H:%M:%S))"
"$PY" -m selfspec train-heads "${COMMON[@]}" --steps "$steps" --eval-every "$steps" --save-every 50 --out "$OUT/heads"
[ -n "$DECODE_FROM" ] || { echo "== done: $OUT/heads (no shipped EAGLE head to take decode settings from: run tune-tree)"; exit 0; }
"$PY" - "$DECODE_FROM" "$OUT/heads" <<'PY'
import sys
from dataclasses import asdict
from selfspec.heads import read_heads_config, write_heads_config
c = read_heads_config(sys.argv[2])
c.decode = read_heads_config(sys.argv[1]).decode
write_heads_config(sys.argv[2], asdict(c))
PY
echo "== done: $OUT/heads ($(date -u +%H:%M:%S))"
