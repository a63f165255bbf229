"""Heads and drafts shipped in this repository for the demo model, and the drafter it uses by default.

One resolver for the Python API, the CLI and the bench: ``checkpoints/<model>/<drafter>/`` holds a
heads directory per drafter, ``checkpoints/<model>/draft-<L>l/`` a distilled draft model, and
``checkpoints/<model>/default.json`` names the drafter that measured fastest (with the bench run
that measured it). In a source checkout that is the repository's own ``checkpoints/``; an installed
package carries the same files as ``selfspec/checkpoints`` (package data, see pyproject.toml).
"""

from __future__ import annotations

import json
from pathlib import Path


def _checkpoints_dir() -> Path:
    here = Path(__file__).resolve().parent
    checkout = here.parent / "checkpoints"
    return checkout if checkout.is_dir() else here / "checkpoints"


CHECKPOINTS = _checkpoints_dir()
# Every drafter name (the registry in drafters/ holds their classes, but importing it loads torch:
# the CLI lists and checks names before that), and those that take a heads directory.
DRAFTER_NAMES = ("none", "early-exit", "medusa", "draft-model", "lookup", "eagle")
HEADS_DRAFTERS = ("medusa", "early-exit", "eagle")
LOOKUP_DRAFTERS = ("lookup", "medusa", "eagle")   # those whose lookup may read a corpus


def shipped_heads(model: str, drafter: str) -> Path | None:
    """Heads shipped for ``model`` (an alias such as ``smollm2-135m``) and ``drafter``, if any."""
    path = CHECKPOINTS / str(model) / drafter
    return path if (path / "config.json").is_file() else None


def shipped_draft(model: str) -> Path | None:
    base = CHECKPOINTS / str(model)
    drafts = sorted(base.glob("draft-*l")) if base.is_dir() else []
    return drafts[0] if drafts else None


def shipped_corpus(model: str) -> Path | None:
    """The corpus of ``model``'s own answers shipped for its lookup (``corpus.py``), if any."""
    path = CHECKPOINTS / str(model) / "corpus"
    return path if (path / "config.json").is_file() else None


def default_drafter(model: str) -> str:
    """The drafter ``drafter="auto"`` means for ``model``: the shipped one default.json names (greedy and
    sampled alike), else the context lookup (it needs no training, and costs nothing when the text does
    not repeat)."""
    path = CHECKPOINTS / str(model) / "default.json"
    if path.is_file():
        return json.loads(path.read_text())["drafter"]
    return "lookup"
