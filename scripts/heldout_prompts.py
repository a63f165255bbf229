"""A held-out prompt file of many kinds, drawn from a broad prompt set no head was trained on.

    python scripts/heldout_prompts.py BROAD_NC.jsonl OUT.jsonl [--per-source 4] [--seed 11]

Reads a JSONL with "id", "source" and "prompt" (the non-commercial broad prompt set: alpaca_eval,
ASDiv, DialogSum, InstructionWild, Multi30k translation, WizardLM test set) and writes, for each
source in sorted order, ``--per-source`` prompts drawn with ``random.Random(seed).sample``, as
``selfspec bench`` reads them (category = the source's first word). The held-out results in
docs/results (``cpu-heldout24-*``) used the defaults. Their licenses keep the prompts themselves
out of this repository.
"""

from __future__ import annotations

import argparse
import json
import random
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--per-source", type=int, default=4)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    by_source: dict[str, list[dict]] = {}
    with open(args.source) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row or "source" not in row:
                print(f"{args.source}:{n}: a row needs \"source\" and \"prompt\"", file=sys.stderr)
                return 2
            by_source.setdefault(row["source"], []).append(row)
    rng = random.Random(args.seed)
    rows = [{"id": r.get("id"), "category": src.split("_")[0], "prompt": r["prompt"]}
            for src in sorted(by_source) for r in rng.sample(by_source[src], min(args.per_source, len(by_source[src])))]
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(rows)} prompts ({len(by_source)} sources) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
