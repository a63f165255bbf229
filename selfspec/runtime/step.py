"""The verify pass at static shapes, compiled once per shape (``compile=True``).

Eager verification (``decode.verify_rows``) builds each step's mask, positions and cache slices in
Python at whatever size the step needs. ``StaticStep`` fixes every shape instead:

* trees are padded to a few sizes (``BUCKETS``); a padding node sees only itself and the past,
  and nothing ever reads what it writes;
* the KV cache is a static ``KVCache`` (capacity fixed up front) that every layer writes in place
  at tensor positions (each row's length + node index) and reads whole;
* the additive mask over the whole capacity is built inside the step from four small tensors
  (tokens, depths, ancestors, row lengths), so nothing on the host depends on the tree's content.

One forward is then a function of fixed shapes with no host synchronisation; ``torch.compile``
compiles it once per (rows, bucket) shape (on CUDA, ``mode="reduce-overhead"`` also captures it
as a CUDA graph). The cache's host-side lengths are updated after the step exactly as the eager
path does, so rollback (``KVCache.keep``) and the drafters are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.backbone import Backbone
from ..core.cache import KVCache, SlotWriter, StaticStorage, move_slots, path_slots
from ..core.decode import _layers, prefill_rows, row_outputs
from ..core.tree import build_tree, tree_mask
from ..core.types import Draft, Drafts, Verified
from .static import BUCKETS, StaticFunction, bucket

CAPACITY_ROUND = 256        # static caches are sized in multiples of this


class StaticStep:
    """Verification of every row's tree in one pass at a static shape; compiled when ``compile``.

    ``capacity`` (positions per row of the static cache) only grows, so a run that ``reserve``s its
    longest sequence up front keeps one shape, and one compiled graph per bucket, throughout."""

    def __init__(self, backbone: Backbone, *, compile: bool = True, mode: str | None = None):
        self.backbone = backbone
        self.compiled = compile
        self.mode = mode
        self.capacity = 0
        self._forward = StaticFunction(self._pass, compile=compile, device=backbone.device, mode=mode)
        # Trees of several nodes on CPU: the weights frozen in, packed (``StaticFunction``). A one-node pass
        # gains nothing from packing, so plain steps keep the weights as they are (and the memory of a copy).
        self._wide = StaticFunction(self._pass, compile=compile, device=backbone.device, mode=mode, freeze=True)
        if not self._wide.frozen:   # (GPU, or not compiled: one pass for every tree)
            self._wide = self._forward
        self._move = StaticFunction(move_slots, compile=compile, device=backbone.device, mode=mode)
        self.storage = StaticStorage(static_address=compile)   # the cache buffers every decode reuses

    def new_cache(self, batch: int, positions: int) -> KVCache:
        """A static cache of ``batch`` rows with room for ``positions`` tokens (``reserve``), on the buffers
        the step keeps for that shape (``cache.StaticStorage``: a compiled pass meets the same addresses)."""
        cache = self.storage.cache(batch, self.reserve(positions))
        cache.mover = self.move
        return cache

    def move(self, cache: KVCache, moves: list[tuple[int, int, torch.Tensor]]) -> None:
        """``KVCache.keep``'s moves (row, start, accepted path offsets) in one static pass over every layer
        (on a GPU one CUDA graph, not a gather per layer): every row of the cache, paths padded to a
        bucket by repeating their last offset (the extra slots land past the row's new length); a row
        with nothing to move copies its first slots onto themselves."""
        M = bucket(max(int(p.shape[0]) for _, _, p in moves))
        src = torch.arange(M).repeat(cache.batch, 1)
        dst = src.clone()
        moved = torch.tensor([b for b, _, _ in moves])
        src[moved], dst[moved] = path_slots(moves, M)
        dev = next(k.device for k in cache.keys if k is not None)
        rows = torch.arange(cache.batch)[:, None].repeat(1, M)
        self._move(cache.keys, cache.values, rows.to(dev), src.to(dev), dst.to(dev))

    @staticmethod
    def bucket(n: int) -> int:
        """The node count a pass of ``n`` nodes per row runs at (``static.bucket``)."""
        return bucket(n)

    def function(self, fn) -> StaticFunction:
        """Another static pass (a drafter's), built as this step builds its own."""
        return StaticFunction(fn, compile=self.compiled, device=self.backbone.device, mode=self.mode)

    def reserve(self, positions: int) -> int:
        """Room for sequences of ``positions`` tokens plus one padded tree; returns the capacity."""
        need = -(-(positions + BUCKETS[-1]) // CAPACITY_ROUND) * CAPACITY_ROUND
        self.capacity = max(self.capacity, need)
        return self.capacity

    @torch.inference_mode()   # as decode_rows runs (a compiled pass guards on the mode)
    def warm_up(self, *, batch: int = 1, max_nodes: int = BUCKETS[1], capture: tuple[int, ...] = ()) -> None:
        """Compile (run once) every bucket up to ``max_nodes`` at ``batch`` rows and the reserved
        capacity, so that timed runs afterwards never compile."""
        cache = self.new_cache(batch, 1)
        prefill_rows(self.backbone, cache, [torch.zeros(1, dtype=torch.long, device=self.backbone.device)] * batch)
        for n in BUCKETS[: BUCKETS.index(bucket(max_nodes)) + 1]:
            tree = build_tree(tuple((0,) * k for k in range(1, n)), self.backbone.device)
            drafts = [Draft(tree=tree, tokens=torch.zeros(n, dtype=torch.long, device=self.backbone.device))] * batch
            self.verify(self.backbone, cache, [1] * batch, drafts, rows=list(range(batch)), capture=capture)
            if n > 1:   # the move of an accepted path as long as this bucket (a scratch one: reversed)
                cache.keep([1] * batch, [torch.arange(n - 1, -1, -1)] * batch)
        self.storage.release(cache)

    def _pass(self, keys, values, tokens, depths, ancestors, lengths, capture: tuple[int, ...], logits: bool):
        bb = self.backbone
        B, n = tokens.shape
        slots = lengths[:, None] + torch.arange(n, device=tokens.device)                    # (B, n)
        rows = torch.arange(B, device=tokens.device)[:, None].expand(B, n)
        mask = tree_mask(ancestors, lengths, keys[0].shape[2], bb.dtype)
        h, mid = _layers(bb, bb.embed_tokens(tokens), start=0, position_ids=lengths[:, None] + depths, mask=mask,
                         cache=SlotWriter(keys, values, rows, slots), capture=capture)
        normed = bb.final_norm(h)
        return normed, mid, (bb.logits(normed) if logits else None)

    def verify(self, backbone: Backbone, cache: KVCache, pasts: list[int], drafts: Sequence[Draft], *, rows: list[int],
               capture: tuple[int, ...] = ()) -> Verified:
        """Verify drafts[i] on cache row rows[i] (its length pasts[i]); the cache's other rows
        (finished sequences, kept so that shapes stay fixed) run a one-node padding tree whose
        write is dropped. Lengths advance as in eager mode (``commit`` then keeps the accepted path)."""
        dev = backbone.device
        B = cache.batch
        if not cache.static or any(k is None for k in cache.keys):
            raise ValueError("the static step runs on a static KV cache that a prefill has filled")
        lens = [cache.lengths[0][b] for b in range(B)]
        for i, (b, d) in enumerate(zip(rows, drafts)):
            if d.resume is not None:      # the static pass runs every layer: drop the drafter's layer < E writes
                cache.truncate(pasts[i], row=b)
            lens[b] = pasts[i]
        drafts = Drafts.of(drafts)
        n = bucket(max(drafts.sizes))
        if max(lens) + n > cache.capacity:
            raise ValueError(f"the static KV cache holds {cache.capacity} positions; this step needs "
                             f"{max(lens) + n}: reserve more")
        batch = drafts.padded(n, dev, rows=rows, batch=B)   # (idle rows: padding trees)
        # (contiguous: a compiled pass is specialised on its inputs' strides, and one tree shared by every row
        # comes expanded)
        forward = self._wide if n > 1 else self._forward
        # With frozen weights the LM head runs in the graph too (packed, padding nodes cost little); otherwise
        # outside it, on real nodes only.
        normed, mid, logits = forward(cache.keys, cache.values, batch.tokens, batch.depths.contiguous(),
                                      batch.ancestors.contiguous(), torch.tensor(lens, device=dev), tuple(capture),
                                      forward.frozen)
        live = set(rows)
        for layer in cache.lengths:         # live rows now hold their n written slots; idle rows are unchanged
            for b in range(B):
                layer[b] = lens[b] + n if b in live else layer[b]
        return row_outputs(backbone, normed, mid, rows, batch.sizes, logits=logits)
