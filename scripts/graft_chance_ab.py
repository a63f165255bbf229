"""Greedy lookup grafts with and without ``agree`` (``lookup.grafted_path_p``), interleaved, one process.

    python scripts/graft_chance_ab.py --prompts PROMPTS.jsonl [--drafters eagle,medusa] [--max-new-tokens 128]

``selfspec bench`` runs each method with the code as it is, so it cannot time a drafter against itself
with one of its own rules off; this does, for the demo model's shipped drafters with their "auto"
settings. "before": a drafted node that a copied chain runs through keeps the draft's own chance (and
the copied nodes below it build on that), as before the rule; "agree": it takes the larger of the
draft's and the copy's. Every prompt runs both (greedy, the order alternating from prompt to prompt)
after one warm-up; outputs must be identical. Prints each drafter's per-prompt speed ratio agree /
before (median and mean), its mean tau both ways, and the median ratio per prompt category.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help="JSONL with prompt and optional category")
    ap.add_argument("--drafters", default="eagle,medusa")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not Path(a.prompts).is_file():
        ap.exit(2, f"graft_chance_ab: --prompts {a.prompts} is not a file (give a JSONL of prompts)\n")
    if a.max_new_tokens < 1 or a.threads < 1:
        ap.exit(2, "graft_chance_ab: --max-new-tokens and --threads must be at least 1\n")
    torch.set_num_threads(a.threads)
    from selfspec import SelfSpeculativeModel
    from selfspec.drafters import lookup

    agree = lookup.grafted_path_p

    def before(*args, **kw):   # the rule off, whatever the caller asks
        return agree(*args, **{**kw, "agree": False})

    variants = {"before": before, "agree": agree}
    rows = [json.loads(line) for line in open(a.prompts) if line.strip()]
    models = {d: SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter=d) for d in a.drafters.split(",")}
    tok = next(iter(models.values())).tokenizer

    def encode(prompt: str) -> torch.Tensor:
        return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt")

    for m in models.values():
        m.generate(encode(rows[0]["prompt"]), max_new_tokens=32)
    res = collections.defaultdict(list)   # (drafter, variant) -> [(tokens/s, tau, category)]
    for i, row in enumerate(rows):
        x = encode(row["prompt"])
        for d, m in models.items():
            outs = {}
            for name in (("before", "agree") if i % 2 else ("agree", "before")):
                lookup.grafted_path_p = variants[name]
                t = time.perf_counter()
                outs[name] = m.generate(x, max_new_tokens=a.max_new_tokens).tolist()
                wall = time.perf_counter() - t
                s = m.last_stats
                res[(d, name)].append((s.new_tokens / wall, s.tau, row.get("category", "")))
            lookup.grafted_path_p = agree
            if outs["before"] != outs["agree"]:
                sys.exit(f"prompt {i}: {d}'s outputs differ between the variants")
        print(i, {f"{d}-{v}": round(res[(d, v)][-1][0], 1) for d in models for v in variants}, flush=True)
    for d in models:
        ratios = [n[0] / o[0] for n, o in zip(res[(d, "agree")], res[(d, "before")])]
        tau = {v: statistics.mean(r[1] for r in res[(d, v)]) for v in variants}
        print(f"{d}: agree / before median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}; "
              f"tau {tau['before']:.3f} -> {tau['agree']:.3f}")
        by = collections.defaultdict(list)
        for r, row in zip(ratios, res[(d, "agree")]):
            by[row[2]].append(r)
        print("  by category:", {c: round(statistics.median(v), 2) for c, v in sorted(by.items())})


if __name__ == "__main__":
    main()
