"""Rewrite a checkpoint's model card (README.md) with dev-prompt accuracy and bench results added.

    python scripts/model_card.py checkpoints/smollm2-135m/medusa --bench bench-out/dev/results.json \
        --method selfspec-medusa --hardware "2-core CPU (no GPU)" --reproduce "selfspec train-heads ..."

Heads directories and distilled drafts (``selfspec_draft.json``) both work; see ``selfspec/card.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfspec.card import write_card


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--bench", default=None, help="results.json of a selfspec bench run")
    ap.add_argument("--method", default=None, help="the bench method these heads were measured as")
    ap.add_argument("--eval", default=None, help="JSON from `selfspec eval-heads --json` on dev prompts")
    ap.add_argument("--hardware", default=None, help="default: this machine (GPU name, else CPU core count)")
    ap.add_argument("--reproduce", action="append", default=[], help="a command that rebuilds it (repeatable, in order)")
    a = ap.parse_args()
    read = lambda path: json.loads(Path(path).read_text()) if path else None  # noqa: E731
    path = write_card(a.checkpoint, bench=read(a.bench), method=a.method, dev_eval=read(a.eval), hardware=a.hardware,
                      reproduce=tuple(a.reproduce))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
