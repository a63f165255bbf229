"""Killed work loses nothing: gen-data, train-heads (every kind) and train-draft, SIGKILLed at random
moments in processes of their own and rerun (with --resume where training), end with exactly what an
uninterrupted run produces, and never leave a torn shard or checkpoint behind.

The runs are forked from a process that imported selfspec already (tests/cli_fork.py), so a run's
time is its work and not the interpreter's imports. Kill times are drawn (seeded) across the
uninterrupted run's own duration, so kills land during model and data loading, feature caching,
training steps and saves alike.
"""

from __future__ import annotations

import json
import os
import random
import time
import zlib
from pathlib import Path
from typing import Callable

import cli_fork
import pytest
import torch
from conftest import tiny_model

V = 97
KILLS = 3


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w1", eos_token="w2")


def _env(home: Path) -> dict:
    return {**os.environ, "SELFSPEC_HOME": str(home), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _log(env: dict) -> Path:
    logs = Path(env["SELFSPEC_HOME"]).parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"{len(list(logs.iterdir())):03d}.log"


def _run(argv: list[str], env: dict) -> float:
    return cli_fork.run(argv, env, _log(env))


def _step(state: Path) -> int:
    """A training run's last checkpointed step (0 before its first)."""
    return torch.load(state, map_location="cpu", weights_only=True)["step"] if state.is_file() else 0


def _shards(out: Path) -> int:
    """A gen-data run's finished shards (a torn one is a ``.tmp-`` directory)."""
    return sum(1 for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")) if out.is_dir() else 0


def _killed_then_finished(argv: list[str], env: dict, duration: float, rng: random.Random,
                          done: Callable[[], int], total: int) -> list[int]:
    """Start ``argv`` KILLS times, SIGKILL each, then run it to the end. The first kill lands at a random
    moment within ``duration`` (start-up, loading, anything). The later ones land as soon as the run's
    progress ``done()`` (checkpointed steps, finished shards) is seen to reach a drawn count at least 4
    short of ``total`` (in the steps or the save after it), so that runs resume from the middle. Returns
    ``done()`` after each kill."""
    after = []
    for i in range(KILLS):
        p = cli_fork.start(argv, env, _log(env))
        if i == 0:
            p.join(rng.uniform(0.3, 0.95) * duration)
        else:
            target = rng.randrange(min(done() + 1, total - 4), total - 3)   # past where it resumes, if there is room
            deadline = time.monotonic() + 10 * duration
            while p.exitcode is None and done() < target and time.monotonic() < deadline:
                time.sleep(0.005)   # the kill lands wherever the run is when this finds the target reached
        if p.exitcode is None:
            p.kill()
            p.join()
        after.append(done())
    _run(argv, env)
    assert any(0 < n < total for n in after), f"not vacuous: some run must resume from the middle ({after})"
    return after


def _no_temporaries(root: Path) -> None:
    left = [p for p in root.rglob("*") if p.name.startswith(".tmp") or p.suffix == ".tmp"]
    assert not left, f"a killed run left temporaries behind: {left[:3]}"


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("kill")
    model = tiny_model("llama", seed=3)
    model.save_pretrained(root / "tiny")
    _tokenizer().save_pretrained(root / "tiny")
    g = random.Random(0)
    rows = [{"id": str(i), "prompt": " ".join(f"w{g.randrange(3, V)}" for _ in range(g.randrange(3, 9)))}
            for i in range(48)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "model": str(root / "tiny"), "env": _env(root / "home")}


def _gen_data(work: dict, out: Path) -> list[str]:
    return ["gen-data", "--model", work["model"], "--prompts", str(work["root"] / "prompts.jsonl"), "--out", str(out),
            "--max-new-tokens", "12", "--batch-size", "2", "--shard-size", "2", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def data(work) -> Path:
    out = work["root"] / "data"
    _run(_gen_data(work, out), work["env"])
    return out


def _rows(directory: Path) -> list[tuple[str, list[int]]]:
    from datasets import concatenate_datasets, load_from_disk

    shards = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    ds = concatenate_datasets([load_from_disk(str(p)) for p in shards])
    id_col = "id" if "id" in ds.column_names else ds.column_names[0]
    tok_col = next(c for c in ("input_ids", "tokens", "ids") if c in ds.column_names)
    return sorted((str(r[id_col]), list(r[tok_col])) for r in ds)


def test_gen_data_killed_at_random_resumes_to_the_same_data(work, data):
    argv = _gen_data(work, work["root"] / "data-killed")
    duration = _run(_gen_data(work, work["root"] / "data-timing"), work["env"])
    killed = work["root"] / "data-killed"
    _killed_then_finished(argv, work["env"], duration, random.Random(1), lambda: _shards(killed),
                          total=_shards(data))
    _no_temporaries(work["root"] / "data-killed")
    assert _rows(work["root"] / "data-killed") == _rows(data)


TRAIN = {
    "medusa": ["train-heads", "--kind", "medusa", "--num-heads", "2"],
    "early-exit": ["train-heads", "--kind", "early-exit"],
    "eagle": ["train-heads", "--kind", "eagle", "--ttt-steps", "2"],
    "draft": ["train-draft", "--layers", "1"],
}


@pytest.mark.parametrize("kind", list(TRAIN))
def test_training_killed_at_random_resumes_to_the_same_weights(kind, work, data):
    def argv(out: Path) -> list[str]:
        return [*TRAIN[kind], "--model", work["model"], "--data", str(data), "--out", str(out), "--steps", "16",
                "--save-every", "2", "--eval-every", "8", "--eval-fraction", "0.1", "--batch-size", "2", "--lr", "3e-3",
                "--warmup", "2", "--draft-vocab-size", "0", "--threads", "1", "--no-progress", "--resume"]

    straight = work["root"] / f"{kind}-straight"
    duration = _run(argv(straight), work["env"])
    killed = work["root"] / f"{kind}-killed"
    _killed_then_finished(argv(killed), work["env"], duration, random.Random(zlib.crc32(kind.encode())),
                          lambda: _step(killed / "trainer_state.pt"), total=16)
    _no_temporaries(killed)
    assert _step(killed / "trainer_state.pt") == 16
    a, b = _tensors(straight / "model.safetensors"), _tensors(killed / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:   # equal only if weights, optimizer moments, schedule and batch order all carried over
        torch.testing.assert_close(b[name], a[name], msg=name)
    # A finished run is ready for a hub upload: its model card carries the hub's front matter.
    card = (straight / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: selfspec\n")
    assert f"# {straight.name}: " + ("distilled draft model" if kind == "draft" else f"{kind} heads") in card
