"""Row projections ``x @ W.T`` in the fastest layout: the LM head, and every few-row product of a layer.

On CPU, BLAS handles a product with a few rows and a wide weight badly. On the 2-core dev box
the 49,152 x 576 LM head takes 10 ms for one row (GEMV), 23 ms for two and 17 ms for four
(GEMM), while the same product taken weight-major, ``(W @ x.T).T``, takes ~5 ms for two to
four rows, and one row padded to two takes ~5 ms. The decoder layers' own products suffer the
same: a 1,536 x 576 MLP weight of the demo model takes 330 us for one row and 410 us for four
through ``F.linear``, 140 us and 200 us in its fastest layout; the 1.5B Qwen target's layers
take 352 ms for one row and 714 ms for two, 252 ms and 310 ms. A decode step is a few rows
(one per sequence, or a tree's nodes), so this decides much of what a step costs.

Which layout wins depends on the BLAS, the CPU, the thread count and the row count, so it is
timed: once per (weight shape, dtype, threads, row count) in the process (``TABLE``), on first
use, and shared by every projection of that shape; later processes on the machine read it back
(``timings.py``). Rows above ``MAX_TUNED_ROWS`` share a timing
per ``ROW_BUCKETS`` step; above the last bucket a product is a proper GEMM and runs as
``F.linear``. The timing runs each layout over the model's own weights of that shape, up to
``TIMING_BYTES`` of them, as a forward streams them: a weight timed again and again sits in
the cache and favours a different layout than the forward meets. A shape with fewer weights than
that (a draft head's) is cycled through, up to ``MAX_TIMING_CALLS`` products: one short product
timed alone is timed mostly by the threads waking up (on the 2-core box a 2-row product with the
EAGLE head's bfloat16 8,192-row LM head timed 250-350 us alone in every layout, and 140 us packed
against 270 us through ``F.linear`` in a burst, which is how drafting meets it).

``Projection`` is the LM head's (and the draft-vocabulary slices'). ``FewRowLinears`` does the
same for the decoder layers while selfspec decodes: a forward pre-hook on each ``nn.Linear``
(torch's public module hooks; the model's code is untouched) computes the product in the timed
layout and hands the module a zero-row input, and a forward hook returns the product as the
module's output. The hooks exist only inside ``with``; calls with gradients on or with more
than ``MAX_LAYER_ROWS`` rows run as they would without them.

A rerouted product pays for the hooks (a pair costs ~15 us a call on the 2-core box even when it
does nothing: 3 ms a token over the demo model's 210 layer products) and a layout only pays where
it saves more than that. So a decoder layer (an element of a ``ModuleList`` holding such
products) hooks, before each forward, only those of its products whose timed layout saves more
than a rerouted call costs (``routing_cost``, timed once per machine) at the forward's row count,
and leaves the others to the module's own call with no hook at all. On that box a one-row step
then runs at transformers' speed (hooking all of them made it ~10% slower) while steps of a few
rows keep their ~20% gain.

The packed layout (``PackedWeights``) is oneDNN's own reordering of a weight; it is the one layout
that costs memory, a second copy of every weight it runs: copies stop at a quarter of physical memory
(``$SELFSPEC_CPU_PACKED=N``: N MB), and ``$SELFSPEC_CPU_PACKED=0`` leaves the layout out of the timing.

The layouts sum in different orders, so values agree to float rounding, not bit for bit: the
same class of difference as any batched forward, and greedy exactness is measured against
transformers like everything else. On CUDA it is always ``F.linear``, and so on a CPU for a precision it has no
instructions for (``emulated``).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from . import timings

# Layers whose weights are smaller than this (elements) are left to F.linear: the hooks would cost
# more than the layout saves. Every weight of the 135M demo model's layers is above it.
MIN_TUNED_ELEMENTS = 1 << 16
# A Projection (an LM head or a draft-vocabulary slice) smaller than this is left to F.linear.
MIN_HEAD_ELEMENTS = 1 << 22
# Row counts up to this are timed one by one; more share a timing per ROW_BUCKETS step (rows up to the
# bucket); above the last bucket a product runs as F.linear. Packed products beat F.linear by ~2x up
# to 128 rows on the 2-core dev box, so the decoder layers' products are rerouted up to the last
# bucket too (MAX_LAYER_ROWS): batches of trees, and short prefills.
MAX_TUNED_ROWS = 16
ROW_BUCKETS = (24, 32, 48, 64, 96, 128, 192, 256)
MAX_LAYER_ROWS = ROW_BUCKETS[-1]
TIMING_REPEATS = 3
TIMING_BYTES = 64 << 20   # weights a timing streams through: more than a CPU's last-level cache
MAX_TIMING_CALLS = 64     # ... in at most this many products

Key = tuple   # (weight shape, dtype, threads, row bucket)
TABLE: dict[Key, dict[str, float]] = {}    # the process's timings: key -> {layout: best seconds per product}
CHOICE: dict[Key, str] = {}                # key -> the layout timed fastest


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


class PackedWeights:
    """oneDNN's own layout of a weight (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU
    freezing computes products with): a copy per weight, made on first use, kept while the weight
    lives and unchanged (its version counter and storage are checked on every use, so a weight that
    training updates in place is packed again). On the 2-core dev box (a throwaway timing script, 40
    weights streamed) a 1,536 x 576 product costs
    ~100 us for 1 to 8 rows and ~140 us for 16 packed, against 185-320 us through ``F.linear`` or
    weight-major: streaming the weight once is all it costs, so a tree of 16 nodes is verified for
    little more than one token. The price is memory: every packed weight is held twice, so copies are
    made only up to ``budget`` bytes in all (``packed_budget``); a weight beyond it is not packed and
    its products run as ``F.linear``."""

    ROWS_HINT = 8     # the row count the layout is prepared for; 4 to 64 time alike on the dev box

    def __init__(self, budget: int | None = None):
        self._kept: dict[int, tuple] = {}    # id(weight) -> (weakref, version, data_ptr, packed, bytes)
        self.bytes = 0
        self.budget = budget                 # None: packed_budget(), read on first use

    def __call__(self, w: torch.Tensor) -> torch.Tensor | None:
        """``w`` packed, or None when packing it would pass the budget."""
        kept = self._kept.get(id(w))
        if kept is not None and kept[0]() is w and kept[1:3] == (w._version, w.data_ptr()):
            return kept[3]
        self._drop(id(w))
        if self.budget is None:
            self.budget = packed_budget()
        size = w.numel() * w.element_size()
        if self.bytes + size > self.budget:
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.ROWS_HINT)
        key = id(w)
        self._kept[key] = (weakref.ref(w, lambda _r, key=key: self._drop(key)), w._version, w.data_ptr(), packed, size)
        self.bytes += size
        return packed

    def _drop(self, key: int) -> None:
        kept = self._kept.pop(key, None)
        if kept is not None:
            self.bytes -= kept[4]


# "0" or "off": never time or use the packed layout; "auto" (or unset): pack up to a quarter of the
# machine's memory; a number: pack up to that many MB.
PACKED_ENV = "SELFSPEC_CPU_PACKED"
PACKED_SHARE_OF_MEMORY = 4     # auto: a 1/4 of physical memory at most goes to packed copies


def packed_budget() -> int:
    """Bytes of packed copies allowed (``$SELFSPEC_CPU_PACKED``: a number of MB, or auto)."""
    setting = os.environ.get(PACKED_ENV, "").strip().lower() or "auto"
    if setting in ("0", "off"):
        return 0
    if setting != "auto":
        try:
            return int(float(setting) * (1 << 20))
        except (ValueError, OverflowError):
            raise ValueError(f"{PACKED_ENV}={setting!r}: use auto, off (or 0), or a number of MB") from None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return total // PACKED_SHARE_OF_MEMORY


PACKED = PackedWeights()


def _packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    packed = PACKED(w)
    if packed is None:                       # over the budget: this weight is not packed
        return F.linear(x, w)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build computes packed products for ``dtype`` here, and they match
    ``F.linear`` (checked once per process on a small product); False when ``$SELFSPEC_CPU_PACKED``
    is 0 or off."""
    if packed_budget() <= 0 or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(64, 32, generator=g).to(dtype), torch.randn(3, 32, generator=g).to(dtype)
        out = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 8), None, "none", [], "")
        return out.shape == (3, 64) and torch.allclose(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "linear": _linear,
    "weight-major": _weight_major,
    "weight-major-pad2": _weight_major_pad2,
    "weight-major-pairs": _weight_major_pairs,
    "packed": _packed,
}


@functools.cache
def emulated(dtype: torch.dtype) -> bool:
    """Whether this CPU has no instructions for ``dtype``'s products (bfloat16 without AVX512-BF16 or
    AMX, float16 without AVX512-FP16 or AMX-FP16; oneDNN's own checks). torch then converts as it
    goes, a product's cost grows with its rows in every layout, and there is nothing to choose: on a
    2-core AVX2 EPYC, bfloat16 ``F.linear`` was the fastest layout or within 4% of it at every row
    count from 1 to 256 and every demo-model shape, and float16 likewise (1 to 16 rows). Such products
    run as ``F.linear``, untimed and not rerouted: timing them cost a bfloat16 bench 150 s there before
    its first token."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if not torch.backends.mkldnn.is_available():
        return True
    check = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
    return not check()


def candidate_layouts(rows: int, dtype: torch.dtype = torch.float32) -> list[str]:
    """The layouts worth timing for this many rows (padding one row, pairing three to eight; packed
    where this torch packs ``dtype``)."""
    return [n for n in LAYOUTS if (n != "weight-major-pad2" or rows == 1) and (n != "weight-major-pairs" or 3 <= rows <= 8)
            and (n != "packed" or packing_works(dtype))]


def row_bucket(rows: int) -> int | None:
    """The row count a timing stands for: itself up to MAX_TUNED_ROWS, then the next ROW_BUCKETS
    entry; None beyond the last (F.linear)."""
    if rows <= MAX_TUNED_ROWS:
        return rows
    return next((b for b in ROW_BUCKETS if b >= rows), None)


def tuning_rows(max_rows: int) -> list[int]:
    """The row counts standing for every count up to ``max_rows``: 1..MAX_TUNED_ROWS, then buckets."""
    top = row_bucket(max_rows) or ROW_BUCKETS[-1]
    return list(range(1, min(max_rows, MAX_TUNED_ROWS) + 1)) + [b for b in ROW_BUCKETS if b <= top]


def layout_for(weights: Sequence[torch.Tensor], x: torch.Tensor) -> str:
    """The layout for ``x (rows, H) @ w.T`` on weights of this shape: timed on first use (over
    ``weights``, each as a forward would meet it), then read from the process's table."""
    w = weights[0]
    bucket = row_bucket(x.shape[0])
    if bucket is None or w.device.type != "cpu" or emulated(w.dtype):
        return "linear"
    key = (tuple(w.shape), w.dtype, torch.get_num_threads(), bucket)
    name = CHOICE.get(key)
    return name if name is not None else tune_layout(key, weights, x)


def tune_layout(key: Key, weights: Sequence[torch.Tensor], x: torch.Tensor) -> str:
    """Time every candidate layout for ``x`` over ``weights`` (at most TIMING_BYTES of them, at least
    one), interleaved so machine drift hits all alike; record and return the fastest."""
    names = candidate_layouts(x.shape[0], key[1])
    kept = timings.get(_kept_key(key))
    if isinstance(kept, dict) and set(names) <= set(kept):   # timed by an earlier process on this machine
        TABLE[key] = {name: float(kept[name]) for name in names}
        CHOICE[key] = min(TABLE[key], key=TABLE[key].get)
        return CHOICE[key]
    per = weights[0].numel() * weights[0].element_size()
    calls = max(1, min(TIMING_BYTES // max(per, 1), MAX_TIMING_CALLS))
    # A shape with fewer weights than that (a draft head's) is cycled through: one short call is timed
    # mostly by the threads waking up, which every layout pays alike, and hides the product's own cost.
    ws = [weights[i % len(weights)] for i in range(calls)]
    for name in names:
        LAYOUTS[name](x, ws[0])                     # warm-up (allocations, BLAS packing)
    best = {name: float("inf") for name in names}
    for _ in range(TIMING_REPEATS):
        for name in names:
            t0 = time.perf_counter()
            for w in ws:
                LAYOUTS[name](x, w)
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    TABLE[key] = best
    CHOICE[key] = min(best, key=best.get)
    timings.put(_kept_key(key), best)
    return CHOICE[key]


def _kept_key(key: Key) -> str:
    shape, dtype, threads, rows = key
    return f"layout-per-call|{'x'.join(map(str, shape))}|{str(dtype).removeprefix('torch.')}|threads={threads}|rows={rows}"


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
            timed_on: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``x (..., H) @ weight.T + bias`` in the layout timed for its row count (``layout_for``, over
    ``timed_on``: the weights of this shape a forward streams; default the weight alone)."""
    rows = x[..., 0].numel()
    if rows == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = LAYOUTS[layout_for(timed_on or (weight,), flat)](flat, weight).reshape(*x.shape[:-1], -1)
    return out if bias is None else out + bias


class Projection:
    """``x (..., H) -> x @ weight.T (..., V)`` with the layout measured fastest for x's row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, autotune: bool = True,
                 min_elements: int = MIN_HEAD_ELEMENTS):
        self.weight = weight                            # (V, H)
        self.bias = bias                                # (V,) or None
        self.autotune = autotune and weight.numel() >= min_elements and not emulated(weight.dtype)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.autotune or self.weight.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return project(x, self.weight, self.bias)

    def tune(self, max_rows: int) -> None:
        """Time now every row bucket up to ``max_rows`` (decoding would time each on first use)."""
        if self.autotune and self.weight.device.type == "cpu":
            for rows in tuning_rows(max_rows):
                self(self.weight.new_zeros(rows, self.weight.shape[1]).normal_())

    def choices(self) -> dict[int, str]:
        """Row bucket -> the layout this weight's shape runs in (what has been timed so far)."""
        w = self.weight
        return {k[3]: v for k, v in CHOICE.items() if k[:3] == (tuple(w.shape), w.dtype, torch.get_num_threads())}


_ROUTING_COST: list[float] = []   # the process's ``routing_cost``, once timed


def routing_cost() -> float:
    """Seconds a product rerouted by ``FewRowLinears`` costs beyond the module's own call (the hooks
    and the layout lookup), timed once per machine on a tiny layer (~20 ms; kept by timings.py)."""
    kept_key = f"routing|threads={torch.get_num_threads()}"
    kept = None if _ROUTING_COST else timings.get(kept_key)
    if isinstance(kept, float):
        _ROUTING_COST.append(kept)
    if not _ROUTING_COST:
        layer = nn.Linear(5, 7, bias=False)       # in no layer: always rerouted while active
        x = torch.zeros(1, 5)
        mode = FewRowLinears(layer, min_elements=0)
        key = (tuple(layer.weight.shape), layer.weight.dtype, torch.get_num_threads(), 1)
        had = key in CHOICE
        CHOICE.setdefault(key, "linear")          # the layout's own cost is not what is timed
        plain, routed = [], []
        with torch.no_grad():
            for _ in range(5):
                for times, ctx in ((plain, nullcontext()), (routed, mode)):
                    with ctx:
                        t0 = time.perf_counter()
                        for _ in range(100):
                            layer(x)
                        times.append((time.perf_counter() - t0) / 100)
        if not had:
            CHOICE.pop(key, None)
        _ROUTING_COST.append(max(0.0, statistics.median(routed) - statistics.median(plain)))
        timings.put(kept_key, _ROUTING_COST[0])
    return _ROUTING_COST[0]


class FewRowLinears:
    """While active (``with``), each CPU ``nn.Linear`` of ``models`` with at least ``min_elements``
    weights (LM heads aside: they are ``Projection``s already) computes products of at most
    ``max_rows`` rows without gradients in the layout timed fastest for its shape and row count,
    timed over the models' weights of that shape. Values agree with ``F.linear`` to float rounding,
    as a batched forward's do. Those inside a decoder layer are rerouted only where that pays
    (module docstring); the others always."""

    def __init__(self, *models: nn.Module | None, min_elements: int = MIN_TUNED_ELEMENTS, max_rows: int = MAX_LAYER_ROWS):
        self.max_rows = max_rows
        self.modules = [m for model in models if model is not None for m in routable(model, min_elements)]
        self.weights: dict[tuple, list[torch.Tensor]] = {}    # (shape, dtype) -> every routed weight of it
        for m in self.modules:
            self.weights.setdefault((tuple(m.weight.shape), m.weight.dtype), []).append(m.weight)
        self.layers = _layers_holding([model for model in models if model is not None], self.modules)
        in_layers = {id(m) for ms in self.layers.values() for m in ms}
        self.loose = [m for m in self.modules if id(m) not in in_layers]   # hooked whenever active
        self.rerouted = 0                                       # products computed here (for tests and reports)
        self._out: dict[int, torch.Tensor] = {}
        self._handles: list = []                                # while active: the layers' hooks, the loose ones'
        self._hooked: dict[int, list] = {}                      # id(linear) -> its two hook handles
        self._pays: dict[tuple, bool] = {}                      # (shape, dtype, threads, rows) -> worth rerouting
        self._want: dict[tuple, tuple[bool, ...]] = {}          # (id(layer), rows) -> which of its products to hook
        self._state: dict[int, tuple[bool, ...]] = {}           # id(layer) -> which are hooked now

    def tune(self, max_rows: int | None = None) -> None:
        """Time now every row count it reroutes (up to ``max_rows``, where the caller knows no forward
        will run more), for every weight shape, and what rerouting costs (decoding would time each on
        first use)."""
        routing_cost()
        top = self.max_rows if max_rows is None else max(1, min(max_rows, self.max_rows))
        for group in self.weights.values():
            for rows in tuning_rows(top):
                project(group[0].new_zeros(rows, group[0].shape[1]).normal_(), group[0], timed_on=group)

    def _before(self, module: nn.Linear, args):
        x = args[0]
        rows = x[..., 0].numel()
        if rows == 0 or rows > self.max_rows or torch.is_grad_enabled() or x.dim() < 2:
            return None
        w = module.weight
        self._out[id(module)] = project(x, w, module.bias, timed_on=self.weights[(tuple(w.shape), w.dtype)])
        self.rerouted += 1
        return (x.narrow(-2, 0, 0),) + tuple(args[1:])      # the module's own product: zero rows

    def _after(self, module: nn.Linear, args, output):
        return self._out.pop(id(module), None)               # None: the module's own output stands

    def _hook(self, m: nn.Linear, on: bool) -> None:
        if on and id(m) not in self._hooked:
            self._hooked[id(m)] = [m.register_forward_pre_hook(self._before), m.register_forward_hook(self._after)]
        elif not on and id(m) in self._hooked:
            for h in self._hooked.pop(id(m)):
                h.remove()

    def _pays_at(self, m: nn.Linear, rows: int) -> bool | None:
        """Whether ``m``'s timed layout at ``rows`` rows saves more than rerouting costs; None while
        untimed."""
        w = m.weight
        key = (tuple(w.shape), w.dtype, torch.get_num_threads(), row_bucket(rows))
        if key not in self._pays:
            timed = TABLE.get(key)
            if timed is None or key not in CHOICE:
                return None
            self._pays[key] = timed["linear"] - timed[CHOICE[key]] > routing_cost()   # per product
        return self._pays[key]

    def _layer_rows(self, layer: nn.Module, args, kwargs):
        """Before a decoder layer's forward: hook those of its products that pay at its row count."""
        h = args[0] if args else kwargs.get("hidden_states")
        rows = h[..., 0].numel() if isinstance(h, torch.Tensor) and h.dim() >= 2 else None
        if rows is not None and (rows > self.max_rows or torch.is_grad_enabled()):
            rows = 0                                    # the module's own product (as ``_before`` would)
        want = self._want.get((id(layer), rows))
        if want is None:
            pays = [None if rows is None else rows > 0 and self._pays_at(m, rows) for m in self.layers[layer]]
            want = tuple(p is not False for p in pays)  # untimed: hooked, so that its first product times it
            if None not in pays:
                self._want[id(layer), rows] = want      # settled: every product's timing is known
        if self._state.get(id(layer)) != want:
            for m, on in zip(self.layers[layer], want):
                self._hook(m, on)
            self._state[id(layer)] = want
        return None

    def __enter__(self) -> "FewRowLinears":
        if not self._handles:
            for m in self.loose:
                self._hook(m, True)
            self._handles = [layer.register_forward_pre_hook(self._layer_rows, with_kwargs=True) for layer in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        for m in self.modules:
            self._hook(m, False)
        self._handles, self._out, self._state = [], {}, {}


def _layers_holding(models: list[nn.Module], linears: list[nn.Linear]) -> dict[nn.Module, list[nn.Linear]]:
    """Decoder layers (elements of a ``ModuleList``, outermost first) -> the ``linears`` inside them."""
    wanted, out, taken = {id(m) for m in linears}, {}, set()
    for model in models:
        for mod in model.modules():
            if not isinstance(mod, nn.ModuleList):
                continue
            for layer in mod:
                inside = [m for m in layer.modules() if id(m) in wanted and id(m) not in taken]
                if inside:
                    out[layer] = inside
                    taken.update(id(m) for m in inside)
    return out


def routable(model: nn.Module, min_elements: int = MIN_TUNED_ELEMENTS) -> list[nn.Linear]:
    """The CPU ``nn.Linear`` modules of ``model`` that ``FewRowLinears`` reroutes (not its LM head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head
            and m.weight.device.type == "cpu" and m.weight.numel() >= min_elements and not emulated(m.weight.dtype)]


def few_row_linears(*models: nn.Module | None, min_elements: int = MIN_TUNED_ELEMENTS):
    """A ``FewRowLinears`` for decoding with these models when one has a layer it reroutes, else a
    no-op context."""
    if any(routable(m, min_elements) for m in models if m is not None):
        return FewRowLinears(*models, min_elements=min_elements)
    return nullcontext()
