"""Checkpoint IO shared by the trainers: whole-or-nothing writes and the resume checks.

``trainer_state.pt`` (weights, optimizer, scheduler, step, RNG, eval history) and every other
checkpoint file are written to a temporary file and ``os.replace``d, with Ctrl-C held meanwhile,
so ``--resume`` continues from the last one and an interrupt never leaves a torn checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import torch

from ..io import atomic_dir, atomic_path, remove_stale_temporaries
from .cli_args import STATE_FILE  # noqa: F401  (defined where the torch-free CLI checks can read it)


@contextlib.contextmanager
def deferred_sigint():
    """Hold Ctrl-C while a checkpoint is written, then raise it: a checkpoint is written whole or not at all."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary file in ``path``'s directory, then renamed over ``path``."""
    with atomic_path(path, mode=None) as tmp:
        torch.save(obj, tmp)


def atomic_save_adapter(lora, path: Path) -> None:
    """Save a peft model's LoRA adapter to directory ``path``, replacing the previous one only once complete."""
    with atomic_dir(path) as tmp:
        lora.save_pretrained(tmp)


def check_resumable(saved: dict, *, differing: list[str], fingerprint: str, vocab, out: Path) -> None:
    """Refuse to resume from trainer state ``saved`` if anything differs from this run.

    ``differing`` names the settings the caller found changed (each kind has its own); the base
    model and the draft vocabulary are checked here, since every kind records both.
    """
    diffs = list(differing)
    if saved["fingerprint"] != fingerprint:
        diffs.append("base model")
    old = saved["vocab"]
    if (old is None) != (vocab is None) or (vocab is not None and not torch.equal(old, vocab.cpu())):
        diffs.append("draft vocabulary (the data changed)")
    if diffs:
        raise ValueError(f"cannot resume {out}: {', '.join(diffs)} differ from the saved run; use another --out")


def open_run(out, *, resume: bool) -> Path:
    """The trainer-state file of a training run writing to ``out``. Refuses an ``out`` that already holds
    a run unless ``resume``; removes the half-written checkpoint files a killed run left."""
    out = Path(out)
    if (out / STATE_FILE).is_file() and not resume:
        raise ValueError(f"{out} already holds a training run: pass --resume to continue it, or choose another --out")
    if out.is_dir():
        remove_stale_temporaries(out)
    return out / STATE_FILE
