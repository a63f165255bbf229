"""Command-line plumbing shared by the training commands (train-heads, train-draft)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable


def flag_type(typ: type) -> Callable[[str], object]:
    """argparse ``type`` for a config field: bools take true/false/1/0/yes/no (``bool("false")`` is True)."""
    if typ is not bool:
        return typ

    def parse(text: str) -> bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")

    parse.__name__ = "bool"
    return parse


def run_module(argv: list[str] | None, *, add_args, run, prog: str, description: str) -> int:
    """``python -m`` entry shared by the training commands: one-line errors, 130 when interrupted."""
    args = add_args(argparse.ArgumentParser(prog=prog, description=description)).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        result = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 130 if result.interrupted else 0
