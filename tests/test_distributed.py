"""Data-parallel training, really run: ``accelerate launch`` with 2 processes (gloo on this CPU) trains
every head kind and a draft to the same weights as one process on the same global batch, writes one
checkpoint from the main process, and resumes after being killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cli_fork
import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file
from test_kill_resume import V, _env, _gen_data, _run, _tokenizer  # noqa: F401  (the same tiny model and data)

KINDS = {
    "medusa": ("selfspec.training.train", ["--kind", "medusa", "--num-heads", "2"]),
    "early-exit": ("selfspec.training.train", ["--kind", "early-exit"]),
    "eagle": ("selfspec.training.train", ["--kind", "eagle", "--ttt-steps", "2"]),
    "draft": ("selfspec.training.draft", ["--layers", "1"]),
}
COMMAND = {"selfspec.training.train": "train-heads", "selfspec.training.draft": "train-draft"}   # the same flags
PORT = 29533


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    import json
    import random

    root = tmp_path_factory.mktemp("ddp")
    model = tiny_model("llama", seed=3)
    model.save_pretrained(root / "tiny")
    _tokenizer().save_pretrained(root / "tiny")
    g = random.Random(0)
    rows = [{"id": str(i), "prompt": " ".join(f"w{g.randrange(3, V)}" for _ in range(g.randrange(3, 9)))}
            for i in range(48)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = {"root": root, "model": str(root / "tiny"), "env": _env(root / "home")}
    _run(_gen_data(work, root / "data"), work["env"])
    return work


def _flags(setup: dict, out: Path, *, batch: int, steps: int = 12) -> list[str]:
    return ["--model", setup["model"], "--data", str(setup["root"] / "data"), "--out", str(out), "--steps", str(steps),
            "--save-every", "4", "--eval-every", "6", "--eval-fraction", "0.1", "--batch-size", str(batch),
            "--lr", "3e-3", "--warmup", "2", "--draft-vocab-size", "0", "--threads", "1", "--no-progress", "--resume"]


def _launch(module: str, argv: list[str], env: dict) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
            str(PORT), "-m", module, *argv]


def _two_processes(module: str, argv: list[str], env: dict) -> str:
    r = subprocess.run(_launch(module, argv, env), env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _close(a: Path, b: Path, atol: float) -> None:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys()
    for name in x:
        torch.testing.assert_close(y[name].float(), x[name].float(), rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_processes_train_what_one_process_trains_on_the_same_global_batch(kind, setup):
    module, kind_flags = KINDS[kind]
    one, two = setup["root"] / f"{kind}-one", setup["root"] / f"{kind}-two"
    log = setup["root"] / f"{kind}-one.log"   # one process: forked from a warm one (tests/cli_fork.py)
    cli_fork.run([COMMAND[module], *kind_flags, *_flags(setup, one, batch=4)], setup["env"], log, timeout=600)
    out = _two_processes(module, [*kind_flags, *_flags(setup, two, batch=2)], setup["env"])
    assert out.count(" done: step 12") == 1                      # one summary, from the main process
    # Same global batch (2 x 2 = 4): the gradients are averaged over processes after each one's loss is
    # divided by the whole batch's counts, so the weights match one process's to float rounding. The draft
    # trains every weight of a model with Adam, whose step on a near-zero gradient is +-lr whatever its
    # rounding: 1.5e-5 apart on one CPU here, against 3e-3 per step for a wrongly split batch.
    _close(one, two, atol=1e-4 if kind == "draft" else 1e-5)
    files = sorted(p.name for p in two.iterdir())
    assert files == sorted(p.name for p in one.iterdir()) and not [f for f in files if f.startswith(".tmp")]
    last = lambda text: [ln for ln in text.splitlines() if "eval step 12" in ln][-1]  # noqa: E731
    assert last(out).split("->")[-1].split(";")[-1] == last(log.read_text()).split("->")[-1].split(";")[-1]


def test_two_processes_killed_mid_run_resume_to_the_same_weights(setup):
    module, kind_flags = KINDS["medusa"]
    straight, killed = setup["root"] / "resume-straight", setup["root"] / "resume-killed"
    _two_processes(module, [*kind_flags, *_flags(setup, straight, batch=2, steps=24)], setup["env"])
    p = subprocess.Popen(_launch(module, [*kind_flags, *_flags(setup, killed, batch=2, steps=24)], setup["env"]),
                         env=setup["env"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state = killed / "trainer_state.pt"
    deadline = time.time() + 300
    while not (state.is_file() and torch.load(state, weights_only=True)["step"] >= 8) and p.poll() is None:
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)   # the launcher and both workers at once
    p.wait()
    assert torch.load(state, weights_only=True)["step"] < 24, "the run finished before it could be killed"
    _two_processes(module, [*kind_flags, *_flags(setup, killed, batch=2, steps=24)], setup["env"])
    _close(straight, killed, atol=1e-6)
