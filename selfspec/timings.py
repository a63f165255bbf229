"""This machine's timings, kept across processes.

What decoding measures about the machine before it can pick well (the product layouts of
``projection.py``, what a rerouted product costs, the verification pass's cost prior of
``budget.py``) is a property of the CPU, the thread count and torch, not of the process. Timing it
took a fresh process 7.8 s for the demo model with its default drafter on a 2-core CPU before the
first token (over a minute while other work shared the cores); reading it back takes 0.17 s.
So each timing is kept in one JSON file per machine, ``$SELFSPEC_HOME/timings/<machine>.json``, and
a later process reads it instead of timing again. The machine key covers the CPU model, the
logical CPU count, the platform and the torch version; the entry keys carry the thread count,
shapes and dtypes.

``$SELFSPEC_TIMINGS`` overrides where: ``off`` times afresh in every process and keeps nothing (the
test suite runs so, to stay hermetic); any other value is the directory to use. Delete the file, or
pass ``--retime`` to ``selfspec bench`` / ``generate``, to time again (e.g. if it was timed while
the machine was busy): the new timings replace the old.

Entries are collected in memory and written (merged with what other processes wrote meanwhile,
atomically) by ``flush``: after tuning, and when the process exits.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import platform
import warnings
from pathlib import Path

import torch

from .io import atomic_write_text
from .loading import selfspec_home

ENV = "SELFSPEC_TIMINGS"
FORMAT = 1

_entries: dict[str, object] | None = None   # the file's entries once read, plus this process's
_new: dict[str, object] = {}                # what this process timed, not yet written
_retime = False                             # time afresh (and replace) rather than read
_registered = False
_warned = False


@functools.cache   # read once: get() and put() ask for the store's path on every call
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What identifies this machine's timings: CPU model, logical CPUs, platform and torch version."""
    ident = "|".join([_cpu_model(), str(os.cpu_count()), platform.system(), platform.machine(), torch.__version__])
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


def store_path() -> Path | None:
    """The file this machine's timings live in; None when ``$SELFSPEC_TIMINGS`` is ``off``."""
    where = os.environ.get(ENV, "").strip()
    if where.lower() == "off":
        return None
    root = Path(where) if where else selfspec_home() / "timings"
    return root / f"{machine_key()}.json"


def _read(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}   # none yet, or unreadable: timed again and rewritten
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def retime(on: bool = True) -> None:
    """Time afresh from now on in this process, replacing what the file holds (``--retime``)."""
    global _retime
    _retime = on


def get(key: str):
    """The kept value of ``key`` (a JSON value), or None: never timed here, the store is off, or retiming."""
    global _entries
    if key in _new:
        return _new[key]
    path = store_path()
    if path is None or _retime:
        return None
    if _entries is None:
        _entries = _read(path)
    return _entries.get(key)


def put(key: str, value) -> None:
    """Keep ``value`` (a JSON value) for ``key``; written by the next ``flush`` (at the latest, at exit)."""
    global _registered
    if store_path() is None:
        return
    _new[key] = value
    if not _registered:
        atexit.register(flush)
        _registered = True


def flush() -> None:
    """Write this process's new timings, merged into the file as it is now. A store that cannot be
    written (read-only home) only costs the next process its timings again (one warning)."""
    global _entries
    path = store_path()
    if path is None or not _new:
        return
    merged = {**_read(path), **_new}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"format": FORMAT, "machine": machine_key(), "entries": merged}))
    except OSError as e:
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(f"cannot keep this machine's timings in {path.parent} ({e.strerror or e}): later runs time "
                          f"them again; set ${ENV} to a writable directory, or to off")
        return
    _entries = merged
    _new.clear()


def reset() -> None:
    """Forget what this process read or timed (for tests: a fresh process's view)."""
    global _entries, _retime
    _entries, _retime = None, False
    _new.clear()
