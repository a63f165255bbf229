"""One drafting rule on and off, interleaved per prompt in one process, for the demo model's shipped drafters.

    python scripts/rule_ab.py --rule RULE --prompts PROMPTS.jsonl [--drafters eagle,medusa] [--max-new-tokens 128]

``selfspec bench`` runs each method with the code as it is, so it cannot time a drafter against itself
with one of its own rules off; this does, with the drafters' "auto" settings. Rules (each on by default
in the library):

* ``agree``: a drafted node that a greedy copied chain runs through takes the larger of the draft's and
  the copy's chance (``lookup.grafted_path_p``); off, it keeps the draft's own.
* ``level-stop``: the EAGLE head stops drafting at a level not expected to pay
  (``EagleDrafter.level_stop``); off, it drafts every level its tree allows.

Every prompt runs both variants (greedy, the order alternating from prompt to prompt) after one
warm-up; outputs must be identical. Prints each drafter's per-prompt speed ratio on / off (median and
mean), its mean tau both ways, and the median ratio per prompt category.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time

import torch


@contextlib.contextmanager
def _off(rule: str):
    """The library with ``rule`` turned off, inside the block."""
    from selfspec.drafters import lookup
    from selfspec.drafters.eagle import EagleDrafter

    if rule == "agree":
        agree = lookup.grafted_path_p
        lookup.grafted_path_p = lambda *args, **kw: agree(*args, **{**kw, "agree": False})
        try:
            yield
        finally:
            lookup.grafted_path_p = agree
        return
    EagleDrafter.level_stop = False   # "level-stop"
    try:
        yield
    finally:
        EagleDrafter.level_stop = True


RULES = ("agree", "level-stop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rule", required=True, choices=RULES)
    ap.add_argument("--prompts", required=True, help="JSONL with prompt and optional category")
    ap.add_argument("--drafters", default="eagle,medusa")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.max_new_tokens < 1 or a.threads < 1:
        ap.exit(2, "rule_ab: --max-new-tokens and --threads must be at least 1\n")
    from selfspec.training.data import load_prompts

    try:
        rows = load_prompts(a.prompts) if a.prompts.endswith(".jsonl") else None
    except ValueError as e:
        ap.exit(2, f"rule_ab: {e}\n")
    if not rows:
        ap.exit(2, f"rule_ab: --prompts {a.prompts} holds no prompts (give a .jsonl file, one {{\"prompt\": ...}} a line)\n")
    drafters = a.drafters.split(",")
    if a.rule != "agree" and drafters != ["eagle"]:
        drafters = ["eagle"]
        print(f"rule_ab: {a.rule} is the EAGLE drafter's; timing --drafters eagle", file=sys.stderr)
    torch.set_num_threads(a.threads)
    from selfspec import SelfSpeculativeModel

    models = {d: SelfSpeculativeModel.from_pretrained("smollm2-135m", drafter=d) for d in drafters}
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
            for name in (("off", "on") if i % 2 else ("on", "off")):
                with _off(a.rule) if name == "off" else contextlib.nullcontext():
                    t = time.perf_counter()
                    outs[name] = m.generate(x, max_new_tokens=a.max_new_tokens).tolist()
                    wall = time.perf_counter() - t
                s = m.last_stats
                res[(d, name)].append((s.new_tokens / wall, s.tau, row.get("category", "")))
            if outs["off"] != outs["on"]:
                sys.exit(f"prompt {i}: {d}'s outputs differ with {a.rule} on and off")
        print(i, {f"{d}-{v}": round(res[(d, v)][-1][0], 1) for d in models for v in ("off", "on")}, flush=True)
    for d in models:
        ratios = [n[0] / o[0] for n, o in zip(res[(d, "on")], res[(d, "off")])]
        tau = {v: statistics.mean(r[1] for r in res[(d, v)]) for v in ("off", "on")}
        print(f"{d}: {a.rule} on / off median {statistics.median(ratios):.3f}, mean {statistics.mean(ratios):.3f}; "
              f"tau {tau['off']:.3f} -> {tau['on']:.3f}")
        by = collections.defaultdict(list)
        for r, row in zip(ratios, res[(d, "on")]):
            by[row[2]].append(r)
        print("  by category:", {c: round(statistics.median(v), 2) for c, v in sorted(by.items())})


if __name__ == "__main__":
    main()
