"""Paste bench results into README.md between the results markers, verbatim (never edited by hand).

    python scripts/readme_results.py docs/results/cpu-dev50 [more result dirs...]

Each directory is a `selfspec bench --out` folder: its command, results.md and speedup.png go in,
in the order given, replacing whatever was between ``<!-- results:start -->`` and ``<!-- results:end -->``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"


def section(run: Path) -> str:
    cfg = json.loads((run / "results.json").read_text())["config"]
    parts = [f"`{cfg['command']}`", "", (run / "results.md").read_text().strip(), ""]
    if (run / "speedup.png").is_file():
        parts += [f"![speedup per method and category]({run / 'speedup.png'})", ""]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 0 if argv else 2
    missing = [d for d in argv if not (Path(d) / "results.json").is_file()]
    if missing:
        print(f"{missing[0]} is not a `selfspec bench --out` directory (no results.json)", file=sys.stderr)
        return 2
    readme = Path("README.md")
    text = readme.read_text()
    if START not in text or END not in text:
        print(f"README.md has no {START} ... {END} block", file=sys.stderr)
        return 2
    body = "\n".join(section(Path(d)) for d in argv)
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{body}\n{END}{tail}")
    print(f"README.md: results from {', '.join(argv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
