#!/usr/bin/env bash
# Train every shipped checkpoint of the demo model in one go, from data made by gen_distill_data.sh:
# Medusa heads, both exit adapters (layer and MLP), and the distilled draft; then tune each drafter's
# tree by measured speed. The backbone feature pass runs once and is shared by all (on-disk cache).
#   scripts/train_demo_checkpoints.sh          (2-core CPU: about 1.5 h; log on stdout)
# Env: THREADS (2), DRAFT_LAYERS (2), DATA (training/data/smollm2-135m-greedy).
# Which exit adapter ships as checkpoints/smollm2-135m/early-exit is decided afterwards by `selfspec bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
THREADS=${THREADS:-2}
L=${DRAFT_LAYERS:-2}
DATA=${DATA:-training/data/smollm2-135m-greedy}
CK=checkpoints/smollm2-135m
for d in "$CK/medusa" "$CK/early-exit" .cache/heads/smollm2-135m-early-exit-mlp "$CK/draft-${L}l"; do
    [ -e "$d/trainer_state.pt" ] && { echo "$d already holds a run: move it away first" >&2; exit 2; }
done
run() { echo "=== $* ($(date -u +%H:%M:%S))"; "$@"; }
T=(--threads "$THREADS")
TUNE=(--data "$DATA" --threads "$THREADS" --prompts-n 6)
run selfspec train-heads --config training/recipes/smollm2-135m-medusa.yaml --data "$DATA" "${T[@]}"
run selfspec tune-tree --model smollm2-135m --heads "$CK/medusa" "${TUNE[@]}"
run selfspec train-heads --config training/recipes/smollm2-135m-early-exit.yaml --data "$DATA" "${T[@]}"
run selfspec tune-tree --model smollm2-135m --heads "$CK/early-exit" "${TUNE[@]}"
run selfspec train-draft --model smollm2-135m --layers "$L" --data "$DATA" --out "$CK/draft-${L}l" \
    --steps 600 --lr 5e-4 --warmup 30 --eval-every 200 --save-every 200 "${T[@]}"
run selfspec train-heads --config training/recipes/smollm2-135m-early-exit-mlp.yaml --data "$DATA" "${T[@]}"
run selfspec tune-tree --model smollm2-135m --heads .cache/heads/smollm2-135m-early-exit-mlp "${TUNE[@]}"
echo "=== done ($(date -u +%H:%M:%S))"
