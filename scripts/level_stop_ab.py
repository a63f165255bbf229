"""EAGLE drafting with and without its level stop (``budget.level_pays``), interleaved, one process.

    python scripts/level_stop_ab.py --prompts training/prompts/dev.jsonl --sample 10 --lookup 0 \
        --variants dynamic-8-4-16:0.05:off,dynamic-8-4-16:0.05:on,dynamic-8-4-16:0:on

``selfspec bench`` runs each method with the code as it is, so it cannot time a drafter against itself
with one of its own mechanisms off; this does, for the shipped EAGLE head on the demo model. Each
variant is TREE:THRESHOLD:on|off (off: every level the tree spec allows, as before the stop). Every
prompt runs every variant (greedy, the order rotating from prompt to prompt) after one warm-up each;
outputs must be identical. Prints tokens/s, tau (token-weighted), the drafting share of the wall time,
and each variant's per-prompt speed ratio to the first (median and mean).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="training/prompts/dev.jsonl")
    ap.add_argument("--sample", type=int, default=10, help="prompts drawn (seed 7) from --prompts")
    ap.add_argument("--lookup", type=int, default=0, help="copied tokens per step (the shipped EAGLE settings use 12)")
    ap.add_argument("--variants", required=True, help="comma-separated TREE:THRESHOLD:on|off")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    variants = []
    for spec in a.variants.split(","):
        parts = spec.split(":")
        try:
            if len(parts) != 3 or parts[2] not in ("on", "off"):
                raise ValueError
            variants.append((spec, parts[0], float(parts[1]), parts[2] == "on"))
        except ValueError:
            ap.error(f"variant {spec!r} is not TREE:THRESHOLD:on|off, e.g. dynamic-8-4-16:0.05:on")
    if a.sample < 1 or a.max_new_tokens < 1:
        ap.error("--sample and --max-new-tokens must be at least 1")
    try:
        rows = [json.loads(line) for line in open(a.prompts) if line.strip()]
    except (OSError, ValueError) as e:
        ap.error(f"cannot read --prompts {a.prompts}: {e}")
    torch.set_num_threads(a.threads)

    from selfspec import SelfSpeculativeModel

    base, models = None, {}
    for spec, tree, threshold, stop in variants:
        if base is None:
            sm = base = SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter="eagle", tree=tree,
                                                             threshold=threshold, lookup=a.lookup)
        else:
            sm = SelfSpeculativeModel(base.model, base.tokenizer, drafter_name="eagle", heads=base.heads, tree=tree,
                                      threshold=threshold, lookup=a.lookup, name="smollm2-135m", corpus=base.corpus)
        sm.drafter.level_stop = stop
        models[spec] = sm
    random.Random(7).shuffle(rows)
    prompts = [base.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"] for r in rows[: a.sample]]
    for sm in models.values():
        sm.generate(prompts[0], max_new_tokens=24)                       # warm-up: layouts, costs, level timings
    names = list(models)
    runs = {k: [] for k in names}                                         # (tokens, seconds, tau, draft share)
    for i, p in enumerate(prompts):
        outs = {}
        for k in names[i % len(names):] + names[: i % len(names)]:
            t = time.perf_counter()
            outs[k] = models[k].generate(p, max_new_tokens=a.max_new_tokens)
            dt, st = time.perf_counter() - t, models[k].last_stats
            runs[k].append((outs[k].shape[1] - p.shape[1], dt, st.tau, st.draft_s / st.wall_s))
        if not all(torch.equal(o, outs[names[0]]) for o in outs.values()):
            sys.exit(f"level_stop_ab.py: prompt {i}: the variants' outputs differ")
        print(i, {k: round(v[-1][0] / v[-1][1], 2) for k, v in runs.items()}, flush=True)
    print(f"| variant | tokens/s | tau | draft share | vs {names[0]}: median | mean |")
    print("|---|---|---|---|---|---|")
    for k, v in runs.items():
        toks, secs = sum(x[0] for x in v), sum(x[1] for x in v)
        ratio = [(x[0] / x[1]) / (y[0] / y[1]) for x, y in zip(v, runs[names[0]])]
        print(f"| {k} | {toks / secs:.2f} | {sum(x[2] * x[0] for x in v) / toks:.2f} | "
              f"{statistics.mean(x[3] for x in v):.0%} | {statistics.median(ratio):.3f} | {statistics.mean(ratio):.3f} |")


if __name__ == "__main__":
    main()
