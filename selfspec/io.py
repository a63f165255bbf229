"""The two things every command does the same way: write a file whole or not at all, and turn a
prompt into the token ids the target sees.

Atomic writes: the content goes to a temporary sibling, which is renamed over the destination only
once complete, so a killed or failing writer never leaves a torn file or directory behind (a
reader sees the old version or the new one). Light on purpose: the CLI imports this before torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

TMP_PREFIX = ".tmp-"
SHARED_FILE_MODE = 0o644   # what selfspec writes is meant to be shared, whatever the umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int | None = SHARED_FILE_MODE) -> Iterator[Path]:
    """Yield a temporary file path for the caller to write (any writer that takes a path:
    ``torch.save``, safetensors' ``save_file``); when the block ends normally it replaces ``path``,
    when it raises the temporary is removed and ``path`` is untouched.

    The temporary file lies in a private directory beside ``path`` (named TMP_PREFIX...), so whatever
    temporaries the writer makes of its own (safetensors writes through one beside its target) land
    there too, and a killed write leaves one directory that :func:`remove_stale_temporaries` deletes."""
    path = Path(path)
    scratch = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}-"))
    tmp = scratch / path.name
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def remove_stale_temporaries(directory: str | os.PathLike) -> None:
    """Delete the temporaries (files or directories named TMP_PREFIX...) a killed writer left in ``directory``.
    Call it only where no live writer can own them (a run that holds the directory)."""
    for p in Path(directory).iterdir():
        if not p.name.startswith(TMP_PREFIX):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)   # another process of the same run may have removed it first


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = SHARED_FILE_MODE) -> None:
    """Replace ``path`` with ``data`` whole (see :func:`atomic_path`)."""
    with atomic_path(path, mode=mode) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int | None = SHARED_FILE_MODE) -> None:
    """Replace ``path`` with ``text`` (UTF-8) whole (see :func:`atomic_path`)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, *, keep_existing: bool = False, prefix: str = TMP_PREFIX) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``path`` to fill; when the block ends normally it
    becomes ``path``, when it raises it is deleted.

    An existing ``path`` is replaced (moved aside, then deleted once the new one is in place), or,
    with ``keep_existing``, kept and the new directory discarded: for caches that a concurrent run
    may have just filled with the same content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{prefix}{path.name}-"))
    try:
        yield tmp
        if path.exists() and keep_existing:
            return
        aside = None
        if path.exists():
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{prefix}old-{path.name}-"))
            os.rename(path, aside / path.name)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (keep_existing and path.exists()):  # else: a concurrent writer got there first
                raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prompt_ids(tokenizer, prompt: str, *, chat: bool) -> list[int]:
    """The token ids the target is given for ``prompt``: with ``chat``, the chat template applied to
    one user turn plus the generation prompt, tokenized without adding special tokens again (the
    template wrote them); without, the raw prompt with the tokenizer's usual special tokens (BOS).

    Rendering to text first and tokenizing that is what ``apply_chat_template`` does inside, and it
    sidesteps its return type (a tensor on older transformers, a ``BatchEncoding`` on newer ones).
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: give some text for the model to answer or continue")
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat formatting asked for (--chat) but the tokenizer has no chat template: drop --chat")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless n is 1: "1 thread", "2 threads" (reports and model cards)."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (imported on first use: the CLI starts without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike) -> None:
    """Lay out ``fig``, write it to ``path`` whole (see :func:`atomic_path`) and free it."""
    fig.tight_layout()
    with atomic_path(path) as tmp:   # (the temporary keeps the name, so its format reads from it)
        fig.savefig(tmp, dpi=120)
    pyplot().close(fig)
