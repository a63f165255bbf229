#!/usr/bin/env bash
# The demo model's own greedy answers to the broad prompt set, in training/data/smollm2-135m-broad-self.
# The prompts are shuffled once (seed 0) and answered in chunks of 400, so a run stopped at any point
# has answered a prefix of the shuffled file; within a call gen-data answers the longest prompts first.
# Rerun to continue: every chunk skips the prompts already stored.
#   BROAD=path/to/broad.jsonl scripts/gen_broad_self.sh [UPTO]      (UPTO: prompts answered in all; default 6000)
# Env: MODEL (smollm2-135m), OUT (training/data/$MODEL-broad-self), THREADS (2), BATCH (24).
set -euo pipefail
cd "$(dirname "$0")/.."
BROAD=${BROAD:?set BROAD to the broad prompt set (JSONL with id, prompt, source)}
UPTO=${1:-6000}
MODEL=${MODEL:-smollm2-135m}
OUT=${OUT:-training/data/$MODEL-broad-self}
THREADS=${THREADS:-2}
BATCH=${BATCH:-24}
SHUF=.cache/prompts/broad-shuf.jsonl
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$(dirname "$SHUF")"
"$PY" - "$BROAD" "$SHUF" <<'PYEOF'
import json, random, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
random.Random(0).shuffle(rows)
with open(sys.argv[2], "w") as f:
    for r in rows:
        f.write(json.dumps({"id": r["id"], "prompt": r["prompt"], "source": r.get("source")}) + "\n")
PYEOF
for ((n = 400; n <= UPTO; n += 400)); do
    "$PY" -m selfspec gen-data --model "$MODEL" --prompts "$SHUF" --out "$OUT" --max-prompts "$n" --max-new-tokens 160 \
        --batch-size "$BATCH" --max-prompt-tokens 384 --shard-size 2 --threads "$THREADS" --no-progress
done
