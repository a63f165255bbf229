#!/usr/bin/env bash
# Train every shipped checkpoint of the demo model from data made by gen_distill_data.sh: Medusa
# heads, both exit adapters (MLP, shipped; decoder layer, compared), and the distilled 2-layer
# draft; then tune each drafter's tree by measured decoding speed. The backbone feature pass runs
# once (in the first command) and is shared by all through the on-disk cache.
#   scripts/train_demo_checkpoints.sh          (2-core CPU, one run after another: about 1.5 h)
# Env: THREADS (2), DATA (the three directories of gen_distill_data.sh, comma-separated, the rows stage 1
# used), WARM_DATA (the same with all self-instruct rows).
# The MLP adapter ships as early-exit/ because its best tree decoded faster than the layer
# adapter's (compare the two tune-tree tables); swap the recipes' `out:` if that ever reverses.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
THREADS=${THREADS:-2}
DATA=${DATA:-training/data/smollm2-135m-greedy@6656,training/data/smollm2-135m-self-instruct@1500,training/data/smollm2-135m-t0.7}
# Medusa stage 2 (warm start from stage 1) adds the second round of self-instruct answers.
WARM_DATA=${WARM_DATA:-training/data/smollm2-135m-greedy@6656,training/data/smollm2-135m-self-instruct@4500,training/data/smollm2-135m-t0.7}
CK=checkpoints/smollm2-135m
LAYER=.cache/heads/smollm2-135m-early-exit-layer
for d in .cache/heads/medusa-v2 "$CK/medusa" "$CK/early-exit" "$LAYER" "$CK/draft-2l"; do
    [ -e "$d/trainer_state.pt" ] && { echo "$d already holds a run: move it away first" >&2; exit 2; }
done
run() { echo "=== $* ($(date -u +%H:%M:%S))"; "$@"; }
T=(--threads "$THREADS")
run selfspec train-heads --config training/recipes/smollm2-135m-medusa.yaml --data "$DATA" "${T[@]}"
run selfspec train-heads --config training/recipes/smollm2-135m-medusa-warm.yaml --data "$WARM_DATA" "${T[@]}"
run selfspec tune-tree --model smollm2-135m --heads "$CK/medusa" --data "$WARM_DATA" "${T[@]}" --prompts-n 6
run selfspec train-heads --config training/recipes/smollm2-135m-early-exit.yaml --data "$DATA" "${T[@]}"
run selfspec tune-tree --model smollm2-135m --heads "$CK/early-exit" --data "$DATA" "${T[@]}" --prompts-n 6
run selfspec train-heads --config training/recipes/smollm2-135m-early-exit-layer.yaml --data "$DATA" "${T[@]}"
run selfspec tune-tree --model smollm2-135m --heads "$LAYER" --data "$DATA" "${T[@]}" --prompts-n 4 --repeats 1
run selfspec train-draft --model smollm2-135m --layers 2 --data "$DATA" --out "$CK/draft-2l" \
    --steps 400 --lr 5e-4 --warmup 30 --eval-every 200 --save-every 200 "${T[@]}"
echo "=== done ($(date -u +%H:%M:%S))"
