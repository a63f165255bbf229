"""scripts/heldout_prompts.py: per-source seeded draws in the bench's format, one-line refusals, nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "heldout_prompts.py"


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_draws_each_source_reproducibly_and_refuses_bad_input(tmp_path):
    src = tmp_path / "broad.jsonl"
    src.write_text("".join(json.dumps({"id": f"{s}-{i}", "source": s, "prompt": f"{s} prompt {i}"}) + "\n"
                           for s in ("alpaca_eval", "asdiv") for i in range(10)))
    out = tmp_path / "held.jsonl"
    r = _run(src, out, "--per-source", 3)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["category"] for r in rows] == ["alpaca"] * 3 + ["asdiv"] * 3
    assert all(r["prompt"].startswith(r["id"].split("-")[0]) for r in rows)
    assert _run(src, tmp_path / "again.jsonl", "--per-source", 3).returncode == 0
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()                         # same seed, same draw
    _run(src, tmp_path / "other.jsonl", "--per-source", 3, "--seed", 5)
    assert (tmp_path / "other.jsonl").read_text() != out.read_text()
    assert _run(src, tmp_path / "new" / "dir" / "held.jsonl", "--per-source", 3).returncode == 0   # as on a fresh clone
    assert (tmp_path / "new" / "dir" / "held.jsonl").read_text() == out.read_text()
    (tmp_path / "a-file").write_text("")   # a parent that is a file: refused

    (tmp_path / "bad.jsonl").write_text('{"prompt": "no source"}\n')
    for args, message in (((tmp_path / "missing.jsonl", tmp_path / "o1.jsonl"), "cannot read"),
                          ((tmp_path / "bad.jsonl", tmp_path / "o2.jsonl"), "needs \"source\""),
                          ((src, tmp_path / "a-file" / "o3.jsonl"), "cannot create"),
                          ((src, tmp_path / "o4.jsonl", "--per-source", 0), "at least 1")):
        r = _run(*args)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not any((tmp_path / f"o{i}.jsonl").exists() for i in range(1, 5))
    assert not list(tmp_path.glob(".*.tmp"))
