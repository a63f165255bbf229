"""Row projections ``x @ W.T`` (the LM head and its draft-vocabulary slices) in the fastest layout.

On CPU, BLAS handles a product with a few rows and a wide weight badly. On the 2-core dev box
the 49,152 x 576 LM head takes 10 ms for one row (GEMV), 23 ms for two and 33 ms for three
(GEMM), while the same product taken weight-major, ``(W @ x.T).T``, takes ~5 ms for two to
five rows, and one row padded to two takes ~7 ms. A verification pass projects every tree node,
a plain step one row, so this is 5-25% of a decode step. Which layout wins depends on the
BLAS, the CPU, the thread count and the row count, so a ``Projection`` times the layouts once
per row count, on first use, and keeps the fastest (``timings`` shows what it measured).

The layouts sum in different orders, so logits agree to float rounding, not bit for bit: the
same class of difference as any batched forward, and greedy exactness is measured against
transformers like everything else. On CUDA (or for small weights) it is always ``F.linear``.

The decoder layers' own products suffer the same on a big model: on the 2-core dev box the 1.5B
Qwen target's layers take 352 ms for one row and 714 ms for two through ``F.linear``, but 252 ms
and 310 ms with each big weight's product in its fastest layout. A verification pass is a few
rows, so this decides whether speculation pays there at all. ``FewRowLinears`` is a
``TorchFunctionMode`` (torch's public hook on its own functions; the model's code is untouched)
that, while decoding, sends ``F.linear`` calls of at most ``MAX_TUNED_ROWS`` rows on a CPU weight
of at least ``MIN_TUNED_ELEMENTS`` through a ``Projection`` per weight shape. Every other call,
and every model whose layers are all small (the 135M demo model's), runs as it would without it.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

# Weights smaller than this (elements) are cheap in any layout: not worth timing.
MIN_TUNED_ELEMENTS = 1 << 22
# More rows than this (a prefill, a big tree) are a proper matrix product, which BLAS handles well.
MAX_TUNED_ROWS = 16
TIMING_REPEATS = 3


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _weight_major(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w @ x.T).T.contiguous()                      # (V, M) -> (M, V)


def _weight_major_pad2(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # One row as a 2-row GEMM: BLAS's GEMV path is the slow one for a single row.
    return (w @ torch.cat([x, x]).T)[:, :1].T.contiguous()


def _weight_major_pairs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Rows two at a time (the last one doubled when odd): on some BLAS a 2-row product costs about
    # what one row does, and less than half of what 4 rows do.
    rows = x.shape[0]
    if rows % 2:
        x = torch.cat([x, x[-1:]])
    return torch.cat([w @ x[i:i + 2].T for i in range(0, x.shape[0], 2)], dim=1)[:, :rows].T.contiguous()


LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": _linear,
    "weight-major": _weight_major,
    "weight-major-pad2": _weight_major_pad2,
    "weight-major-pairs": _weight_major_pairs,
}


def candidate_layouts(rows: int) -> list[str]:
    """The layouts worth timing for this many rows (padding one row, pairing three or more)."""
    return [n for n in LAYOUTS if (n != "weight-major-pad2" or rows == 1) and (n != "weight-major-pairs" or rows >= 3)]


class Projection:
    """``x (..., H) -> x @ weight.T (..., V)`` with the layout measured fastest for x's row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, autotune: bool = True,
                 min_elements: int | None = None):
        self.weight = weight                            # (V, H)
        self.bias = bias                                # (V,) or None
        self.autotune = autotune and weight.numel() >= (MIN_TUNED_ELEMENTS if min_elements is None else min_elements)
        self.choice: dict[int, str] = {}               # rows -> layout name
        self.timings: dict[int, dict[str, float]] = {}  # rows -> {layout: best seconds}

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.weight, self.bias)

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias`` for a weight of this one's shape (``FewRowLinears`` shares the timings)."""
        lead, rows = x.shape[:-1], x[..., 0].numel()
        if not self.autotune or rows == 0 or weight.device.type != "cpu":
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        name = self.choice.get(rows) or self._tune(flat)
        out = LAYOUTS[name](flat, weight).reshape(*lead, -1)
        return out if bias is None else out + bias

    def _tune(self, flat: torch.Tensor) -> str:
        rows = flat.shape[0]
        names = candidate_layouts(rows)
        for name in names:
            LAYOUTS[name](flat, self.weight)            # warm-up (allocations, BLAS packing)
        best = {name: float("inf") for name in names}
        for _ in range(TIMING_REPEATS):                 # interleaved, so machine drift hits all alike
            for name in names:
                t0 = time.perf_counter()
                LAYOUTS[name](flat, self.weight)
                best[name] = min(best[name], time.perf_counter() - t0)
        self.timings[rows] = best
        self.choice[rows] = min(best, key=best.get)
        return self.choice[rows]


class FewRowLinears(TorchFunctionMode):
    """While active, ``F.linear`` with at most ``max_rows`` rows on a big CPU weight runs in the layout
    measured fastest for that weight shape and row count (timed once per process and thread count).
    Values agree with ``F.linear`` to float rounding, as a batched forward's do."""

    def __init__(self, *, min_elements: int = MIN_TUNED_ELEMENTS, max_rows: int = MAX_TUNED_ROWS):
        super().__init__()
        self.min_elements, self.max_rows = min_elements, max_rows
        self.by_shape: dict[tuple, Projection] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not torch.is_grad_enabled():
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.device.type == "cpu" and w.numel() >= self.min_elements and 0 < x[..., 0].numel() <= self.max_rows:
                key = (tuple(w.shape), w.dtype, torch.get_num_threads())
                proj = self.by_shape.get(key)
                if proj is None:
                    proj = self.by_shape[key] = Projection(w, min_elements=self.min_elements)
                return proj.apply(x, w, bias)
        return func(*args, **kwargs)


def few_row_linears(*models: nn.Module | None, min_elements: int = MIN_TUNED_ELEMENTS):
    """A ``FewRowLinears`` for decoding with these models when one has a CPU ``nn.Linear`` of at least
    ``min_elements`` weights, else a no-op context (a small model would pay the hook's per-call cost
    for nothing)."""
    for model in (m for m in models if m is not None):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for m in model.modules():   # the LM head is a Projection of its own already
            if isinstance(m, nn.Linear) and m is not head and m.weight.device.type == "cpu" \
                    and m.weight.numel() >= min_elements:
                return FewRowLinears(min_elements=min_elements)
    return nullcontext()
