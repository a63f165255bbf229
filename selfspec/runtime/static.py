"""What every static-shape pass shares (``compile=True``): the tree sizes passes are padded to, and
how a pass function is compiled (``StaticFunction``). The verify step (``step.py``) and the eagle
head's draft step (``drafters/eagle.py``) are both built from these."""

from __future__ import annotations

import contextlib

import torch

# Tree sizes a step is padded to. On CPU a pass over 4 or 16 nodes costs little more than over 2 or
# 8 (few-row products are bound by reading the weights), while each size compiles on its own (over a
# minute on CPU): so few, coarse buckets.
BUCKETS = (1, 4, 16, 64)


def bucket(n: int) -> int:
    """The smallest bucket holding n nodes (n beyond the largest: n itself, compiled on its own)."""
    return next((b for b in BUCKETS if b >= n), n)


class StaticFunction:
    """``fn`` run at static shapes: through ``torch.compile`` when ``compile``, else as it is. Every
    static pass (the verify step of ``step.py``, the eagle head's draft step) is built so.

    On CUDA, ``mode`` "reduce-overhead" also captures each shape as a CUDA graph. Elsewhere each shape
    compiles with inductor's ``cpp_wrapper`` (the code that calls its kernels is C++ as well, which on a
    small model is much of a step's host work); with ``freeze``, also with inductor's freezing: the
    weights become constants of the compiled code, packed once in the layout the machine's matrix
    library reads fastest, so that a pass over several nodes costs less over one than it does eagerly.
    Each shape so compiled keeps its own packed copy of the weights it reads, and reads them once: a
    weight changed in place afterwards is not seen by it.

    A CUDA graph's outputs live in its memory pool until its next replay, and callers keep some
    (a drafter's output states, the captured features) longer: so each call starts a new replay and
    returns copies of the outputs."""

    def __init__(self, fn, *, compile: bool, device: torch.device, mode: str | None = None, freeze: bool = False):
        self.compiled = compile
        self.graphs = False
        self._around = contextlib.nullcontext()   # what each call runs in
        self.frozen = False
        if not compile:
            self._fn = fn
            return
        if mode is None:
            mode = "reduce-overhead" if device.type == "cuda" else None
        self.graphs = mode == "reduce-overhead"
        import warnings

        import torch._dynamo

        # torch's own compiler calls a deprecated API of itself (once per kernel): not the user's concern.
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.*")
        # One graph per shape (rows, bucket, capacity, capture); a run meets a handful.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        if mode is None:   # (CPU) the compiled function's own host code in C++ too, not a Python wrapper
            self._fn = torch.compile(fn, dynamic=False, options={"cpp_wrapper": True})
            if freeze:   # (read as a shape is traced, not from ``options``: set around each call)
                import torch._inductor.config

                self._around = torch._inductor.config.patch(freezing=True)
                self.frozen = True
        else:
            self._fn = torch.compile(fn, mode=mode, dynamic=False)

    def __call__(self, *args):
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()   # a new replay: the previous one's outputs are done with
        with self._around:
            out = self._fn(*args)
        return _copied(out) if self.graphs and out is not None else out


def _copied(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(_copied(x) for x in out)
