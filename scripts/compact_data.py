#!/usr/bin/env python3
"""Rewrite older gen-data directories (int32 token ids) as uint16 where the vocabulary fits: the same
rows, in the same order, at about half the size on disk. Safe to stop and rerun.

    scripts/compact_data.py DIR [DIR ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from selfspec.training.data import compact_data  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    for d in argv:
        try:
            n, before, after = compact_data(d)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{d}: {n} shards rewritten, {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
