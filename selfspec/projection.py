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
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.nn import functional as F

# Weights smaller than this (elements) are cheap in any layout: not worth timing.
MIN_TUNED_ELEMENTS = 1 << 22
TIMING_REPEATS = 3


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _weight_major(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w @ x.T).T.contiguous()                      # (V, M) -> (M, V)


def _weight_major_pad2(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # One row as a 2-row GEMM: BLAS's GEMV path is the slow one for a single row.
    return (w @ torch.cat([x, x]).T)[:, :1].T.contiguous()


LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": _linear,
    "weight-major": _weight_major,
    "weight-major-pad2": _weight_major_pad2,
}


class Projection:
    """``x (..., H) -> x @ weight.T (..., V)`` with the layout measured fastest for x's row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, autotune: bool = True):
        self.weight = weight                            # (V, H)
        self.bias = bias                                # (V,) or None
        self.autotune = autotune and weight.numel() >= MIN_TUNED_ELEMENTS
        self.choice: dict[int, str] = {}               # rows -> layout name
        self.timings: dict[int, dict[str, float]] = {}  # rows -> {layout: best seconds}

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, rows = x.shape[:-1], x[..., 0].numel()
        if not self.autotune or rows == 0 or self.weight.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        name = self.choice.get(rows) or self._tune(flat)
        out = LAYOUTS[name](flat, self.weight).reshape(*lead, -1)
        return out if self.bias is None else out + self.bias

    def _tune(self, flat: torch.Tensor) -> str:
        rows = flat.shape[0]
        names = [n for n in LAYOUTS if n != "weight-major-pad2" or rows == 1]
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
