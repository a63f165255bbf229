"""A held-out prompt file of many kinds, drawn from a broad prompt set no head was trained on.

    python scripts/heldout_prompts.py BROAD_NC.jsonl OUT.jsonl [--per-source 4] [--seed 11]

Reads a JSONL with "id", "source" and "prompt" (the non-commercial broad prompt set: alpaca_eval,
ASDiv, DialogSum, InstructionWild, Multi30k translation, WizardLM test set) and writes, for each
source in sorted order, ``--per-source`` prompts drawn with ``random.Random(seed).sample``, as
``selfspec bench`` reads them (category = the source's first word). The held-out results in
docs/results used the defaults. Their licenses keep the prompts themselves
out of this repository.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path


def _fail(message: str) -> int:
    print(f"heldout_prompts: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--per-source", type=int, default=4)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    if args.per_source < 1:
        return _fail(f"--per-source must be at least 1 (got {args.per_source})")
    by_source: dict[str, list[dict]] = {}
    try:
        with open(args.source) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return _fail(f"{args.source}:{n}: not a JSON line")
                if not isinstance(row, dict) or "prompt" not in row or "source" not in row:
                    return _fail(f"{args.source}:{n}: a row needs \"source\" and \"prompt\"")
                by_source.setdefault(row["source"], []).append(row)
    except OSError as e:
        return _fail(f"cannot read {args.source}: {e.strerror}")
    if not by_source:
        return _fail(f"{args.source} holds no prompts")
    rng = random.Random(args.seed)
    rows = [{"id": r.get("id"), "category": src.split("_")[0], "prompt": r["prompt"]}
            for src in sorted(by_source) for r in rng.sample(by_source[src], min(args.per_source, len(by_source[src])))]
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _fail(f"cannot create {out.parent}: {e.strerror}")
    tmp = out.with_name(f".{out.name}.tmp")   # written whole, then renamed: never half a file at OUT
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out)
    print(f"wrote {len(rows)} prompts ({len(by_source)} sources) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
