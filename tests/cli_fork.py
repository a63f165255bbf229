"""selfspec's command line in processes forked from a warm one (multiprocessing's fork server).

The server imports torch, transformers, datasets, accelerate and selfspec once; every run is then a
fork of it that calls ``selfspec.cli.main(argv)``, as ``python -m selfspec`` does, in a process of its
own. On a small CPU a fresh interpreter spends ~10 s importing transformers before any work, which made
the kill/resume tests mostly time imports and land most of their kills inside them. A forked run starts
at once, so kills land in the work (data loading, steps, saves) and a SIGKILL is still a SIGKILL.

The server runs with one OpenMP thread and does nothing but import, so no thread pool exists when it
forks.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
import time
from pathlib import Path
from unittest import mock

PRELOAD = ["transformers.modeling_utils", "datasets", "accelerate", "safetensors.torch", "selfspec.cli",
           "selfspec.training.train", "selfspec.training.draft", "selfspec.training.data"]

_context = None


def _ctx():
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # The server's own environment: one thread, offline, no tokenizer threads (what each run sets too).
        with mock.patch.dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"):
            multiprocessing.forkserver.ensure_running()
        _context = ctx
    return _context


def _main(argv: list[str], env: dict, log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from selfspec.cli import main

    sys.argv = ["selfspec", *argv]
    sys.exit(main(argv))


def start(argv: list[str], env: dict, log: Path) -> multiprocessing.Process:
    """Start ``selfspec ARGV`` with environment ``env``; its stdout and stderr go to ``log``."""
    p = _ctx().Process(target=_main, args=(list(argv), dict(env), str(log)))   # not daemonic: a run may start processes of its own
    p.start()
    return p


def run(argv: list[str], env: dict, log: Path, timeout: float = 300) -> float:
    """Run ``selfspec ARGV`` to the end; fail with the tail of its output unless it exits 0. Returns seconds."""
    t0 = time.perf_counter()
    p = start(argv, env, log)
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise AssertionError(f"selfspec {' '.join(argv[:1])} ran over {timeout} s")
    assert p.exitcode == 0, f"exit {p.exitcode}: " + (Path(log).read_text()[-2000:] if Path(log).is_file() else "no output")
    return time.perf_counter() - t0
