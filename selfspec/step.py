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

import torch

from .backbone import Backbone
from .cache import KVCache
from .decode import _layers, prefill_rows, row_outputs
from .drafters.base import Draft, TargetOut
from .tree import build_tree

# Tree sizes a step is padded to. On CPU a pass over 4 or 16 nodes costs little more than over 2 or
# 8 (few-row products are bound by reading the weights), while each size compiles on its own (over a
# minute on CPU): so few, coarse buckets.
BUCKETS = (1, 4, 16, 64)
CAPACITY_ROUND = 256        # static caches are sized in multiples of this


def bucket(n: int) -> int:
    """The smallest bucket holding n nodes (n beyond the largest: n itself, compiled on its own)."""
    return next((b for b in BUCKETS if b >= n), n)


class _SlotWriter:
    """What the layers call ``cache.update`` on inside the step: write at tensor slots, read all."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: torch.Tensor, slots: torch.Tensor):
        self.keys, self.values, self.rows, self.slots = keys, values, rows, slots

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        K, V = self.keys[layer_idx], self.values[layer_idx]
        K[self.rows, :, self.slots] = key.transpose(1, 2)      # (B, n, kv_heads, head_dim) into (B, kv_heads, C, d)
        V[self.rows, :, self.slots] = value.transpose(1, 2)
        return K, V

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def static_mask(ancestors: torch.Tensor, lengths: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, n, capacity) mask: row b's queries see its slots [0, lengths[b]) and, among
    its n new slots starting at lengths[b], those ``ancestors[b]`` (B, n, n) allows."""
    n = ancestors.shape[-1]
    rel = torch.arange(capacity, device=lengths.device)[None] - lengths[:, None]          # (B, C)
    in_tree = (rel >= 0) & (rel < n)
    tree = ancestors.gather(2, rel.clamp(0, n - 1)[:, None].expand(-1, n, -1)) & in_tree[:, None]
    vis = (rel < 0)[:, None] | tree                                                        # (B, n, C)
    return torch.where(vis, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


class StaticStep:
    """Verification of every row's tree in one pass at a static shape; compiled when ``compile``.

    ``capacity`` (positions per row of the static cache) only grows, so a run that ``reserve``s its
    longest sequence up front keeps one shape, and one compiled graph per bucket, throughout."""

    def __init__(self, backbone: Backbone, *, compile: bool = True, mode: str | None = None):
        self.backbone = backbone
        self.compiled = compile
        self.capacity = 0
        if compile:
            if mode is None:
                mode = "reduce-overhead" if backbone.device.type == "cuda" else None
            import warnings

            import torch._dynamo

            # torch's own compiler calls a deprecated API of itself (once per kernel): not the user's concern.
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.*")

            # One graph per (rows, bucket, capacity, capture); a run meets a handful.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._forward = torch.compile(self._pass, mode=mode, dynamic=False)
        else:
            self._forward = self._pass

    def reserve(self, positions: int) -> int:
        """Room for sequences of ``positions`` tokens plus one padded tree; returns the capacity."""
        need = -(-(positions + BUCKETS[-1]) // CAPACITY_ROUND) * CAPACITY_ROUND
        self.capacity = max(self.capacity, need)
        return self.capacity

    @torch.no_grad()
    def warm_up(self, *, batch: int = 1, max_nodes: int = BUCKETS[1], capture: tuple[int, ...] = ()) -> None:
        """Compile (run once) every bucket up to ``max_nodes`` at ``batch`` rows and the reserved
        capacity, so that timed runs afterwards never compile."""
        cache = KVCache(batch, capacity=self.reserve(1))
        prefill_rows(self.backbone, cache, [torch.zeros(1, dtype=torch.long, device=self.backbone.device)] * batch)
        for n in BUCKETS[: BUCKETS.index(bucket(max_nodes)) + 1]:
            tree = build_tree(tuple((0,) * k for k in range(1, n)), self.backbone.device)
            drafts = [Draft(tree=tree, tokens=torch.zeros(n, dtype=torch.long, device=self.backbone.device))] * batch
            self.verify(self.backbone, cache, [1] * batch, drafts, rows=list(range(batch)), capture=capture)

    def _pass(self, keys, values, tokens, depths, ancestors, lengths, capture: tuple[int, ...]):
        bb = self.backbone
        B, n = tokens.shape
        slots = lengths[:, None] + torch.arange(n, device=tokens.device)                    # (B, n)
        rows = torch.arange(B, device=tokens.device)[:, None].expand(B, n)
        mask = static_mask(ancestors, lengths, keys[0].shape[2], bb.dtype)
        h, mid = _layers(bb, bb.embed_tokens(tokens), start=0, position_ids=lengths[:, None] + depths, mask=mask,
                         cache=_SlotWriter(keys, values, rows, slots), capture=capture)
        return bb.final_norm(h), mid

    def verify(self, backbone: Backbone, cache: KVCache, pasts: list[int], drafts: list[Draft], *, rows: list[int],
               capture: tuple[int, ...] = ()) -> list[TargetOut]:
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
        n = bucket(max(d.tree.size for d in drafts))
        if max(lens) + n > cache.capacity:
            raise ValueError(f"the static KV cache holds {cache.capacity} positions; this step needs "
                             f"{max(lens) + n}: reserve more")
        tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
        depths = torch.zeros(B, n, dtype=torch.long, device=dev)
        anc = torch.eye(n, dtype=torch.bool, device=dev).repeat(B, 1, 1)
        for b, d in zip(rows, drafts):
            m = d.tree.size
            tokens[b, :m] = d.tokens.to(dev)
            depths[b, :m] = d.tree.depths.to(dev)
            anc[b, :m, :m] = d.tree.ancestors.to(dev)
        graphs = self.compiled and dev.type == "cuda"
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()   # a new step: the previous replay's outputs are done with
        normed, mid = self._forward(cache.keys, cache.values, tokens, depths, anc,
                                    torch.tensor(lens, device=dev), tuple(capture))
        if graphs:   # a CUDA graph's outputs live in its pool until the next replay: drafters keep some longer
            normed, mid = normed.clone(), tuple(c.clone() for c in mid)
        live = set(rows)
        for layer in cache.lengths:         # live rows now hold their n written slots; idle rows are unchanged
            for b in range(B):
                layer[b] = lens[b] + n if b in live else layer[b]
        # The LM head outside the graph, on real nodes only (as eagerly): padding never pays for it.
        return row_outputs(backbone, normed, mid, rows, [d.tree.size for d in drafts])
