"""A copy of the shipped EAGLE head whose decode settings draft a wide tree, uncut (threshold 0).

    python scripts/wide_eagle.py OUT_DIR [SPEC]

SPEC is an eagle tree (``dynamic-D-K-M``) or ``default``: ``dynamic-10-8-W``, with W = 63 minus the shipped
lookup's copied tokens, so that a draft (root, nodes, copied tokens) fills the largest compiled bucket
(``selfspec.runtime.static.BUCKETS``). The copied tokens stay as shipped.

Why: the shipped settings were tuned on a CPU, where each verified node costs a visible share of a
step, and stop at 16 nodes; a GPU verifies 64 for about the price of one. ``scripts/gpu_check.sh``
benches this copy beside the shipped settings, so a GPU run shows what a wide tree gives there. Bad
input: one line on stderr, exit 2, nothing written.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

MODEL = "smollm2-135m"


def wide_settings(spec: str, lookup: int, largest: int) -> dict:
    """The decode section: SPEC (or the default that fills the largest bucket beside ``lookup`` copied
    tokens) with ``lookup`` copied tokens."""
    from selfspec.settings import check_settings

    tree = f"dynamic-10-8-{largest - 1 - lookup}" if spec == "default" else spec
    check_settings("eagle", tree=tree)
    return {"tree": tree, "threshold": 0.0, "gate": 0.0, "lookup": lookup}


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("wide_eagle: usage: python scripts/wide_eagle.py OUT_DIR [SPEC]", file=sys.stderr)
        return 2
    out, spec = Path(argv[0]), argv[1] if len(argv) == 2 else "default"
    from selfspec.runtime.static import BUCKETS
    from selfspec.shipped import shipped_heads

    src = shipped_heads(MODEL, "eagle")
    if src is None:
        print(f"wide_eagle: {MODEL} has no shipped EAGLE head to copy", file=sys.stderr)
        return 2
    config = json.loads((Path(src) / "config.json").read_text())
    try:
        decode = wide_settings(spec, int((config.get("decode") or {}).get("lookup") or 0), BUCKETS[-1])
    except ValueError as e:
        print(f"wide_eagle: {spec}: {e}", file=sys.stderr)
        return 2
    config["decode"] = decode
    shutil.rmtree(out, ignore_errors=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(Path(src) / "model.safetensors", tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    print(f"{decode['tree']} with {decode['lookup']} copied tokens: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
