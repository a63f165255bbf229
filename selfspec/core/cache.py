"""The KV cache: selfspec's own, reached by the decoder layers through their public forward argument.

A decoder layer of every supported family stores and reads its keys and values through one call,
``cache.update(key, value, layer_idx, ...)``, which returns everything the new queries attend
over. ``KVCache`` answers that call with preallocated buffers, one per layer, shaped
(B, kv_heads, capacity, head_dim), and a length per layer and row. Nothing here touches a
transformers cache class.

Layout of a row: its tokens sit at slots [0, length) in order, so rows of different lengths
(ragged prompts, different accepted paths) share one buffer with no holes. A batched forward
writes each row's n new slots right after that row's own tokens and returns slots
[0, max length + n): what lies beyond a row's own slots is stale and the caller's mask hides it
(``tree.tree_mask``). A one-row forward through ``row(b)`` sees exactly that row's slots, so
code written for one sequence (a drafter running layers on the target's cache) needs no mask.

After a verification step speculative decoding needs two operations, both per row and on every
layer:

* ``truncate(length)``: keep the first slots (a chain drafter's cache after a rejection);
* ``keep(starts, paths)``: keep slots [0, start) plus ``start + path``, in order (the accepted
  path of a tree, moved into place, gpt-fast style: a gather and a length update, no reallocation).

Layers may be at different lengths mid-step (early exit writes layers < E first); every operation
acts on each layer on its own and leaves every layer at the stated length.

``capacity`` given up front makes the cache static (buffers never move; exceeding it is an
error); without it the buffers grow by doubling, which is what one-off callers want.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch


class KVCache:
    def __init__(self, batch: int = 1, *, capacity: int | None = None,
                 storage: "tuple[list, list] | None" = None, static_address: bool = False):
        """storage: (keys, values) lists of a ``StaticStorage`` (a static cache only): buffers already there
        are reused as they are (their old contents are stale slots), missing ones are allocated into them.
        static_address: mark each buffer allocated a static address for torch.compile (``StaticStorage``)."""
        if batch < 1:
            raise ValueError(f"a cache needs at least one row (got batch={batch})")
        if storage is not None and capacity is None:
            raise ValueError("reused storage needs a static cache: give its capacity")
        self.batch = batch
        self.static = capacity is not None
        self.capacity = int(capacity) if capacity is not None else 64
        self.keys: list[torch.Tensor | None] = [] if storage is None else storage[0]
        self.values: list[torch.Tensor | None] = [] if storage is None else storage[1]
        self.static_address = static_address
        # keep()'s moves of accepted paths, where a static step runs them as one pass (``StaticStep.move``);
        # None: here, a gather per layer
        self.mover: Callable[[KVCache, list[tuple[int, int, torch.Tensor]]], None] | None = None
        self.lengths: list[list[int]] = []          # [layer][row], on the host: no device sync to read
        self._index: dict = {}                       # (row lengths, n) -> write index, reused across layers

    # ------------------------------------------------------------------ what the layers call
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append (B, kv_heads, n, head_dim) after each row's tokens; return slots [0, max length + n)."""
        return self._write(layer_idx, key, value, rows=None)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row of ``layer_idx`` (what one-sequence code means by the cache's length)."""
        return max(self.lengths[layer_idx]) if layer_idx < len(self.lengths) else 0

    # ------------------------------------------------------------------ rows
    def row(self, b: int) -> "RowView":
        """Row ``b`` as a one-sequence cache: writes go after that row's own tokens, reads see only them."""
        return RowView(self, b)

    def rows(self, rows: list[int]) -> "KVCache | RowView | RowsView":
        """Rows ``rows`` (in that order) as a cache of len(rows) rows: a forward writes each row's new
        slots after that row's own tokens and reads slots [0, their longest + n) (the caller's mask hides
        what lies beyond a row's own). All rows: the cache itself; one row: ``row``."""
        if list(rows) == list(range(self.batch)):
            return self
        return self.row(rows[0]) if len(rows) == 1 else RowsView(self, list(rows))

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows``, in that order (finished sequences leave the batch and stop costing work)."""
        if rows == list(range(self.batch)):
            return
        idx = None
        for i, k in enumerate(self.keys):
            if k is not None:
                idx = torch.tensor(rows, device=k.device) if idx is None else idx
                self.keys[i], self.values[i] = k.index_select(0, idx), self.values[i].index_select(0, idx)
        self.lengths = [[lens[r] for r in rows] for lens in self.lengths]
        self.batch = len(rows)
        self._index.clear()

    def layer(self, index: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of one layer and row, each (1, kv_heads, length, head_dim): views, for reading."""
        n = self.lengths[index][row]
        return self.keys[index][row:row + 1, :, :n], self.values[index][row:row + 1, :, :n]

    def row_lengths(self, layer: int = 0) -> list[int]:
        return list(self.lengths[layer]) if layer < len(self.lengths) else [0] * self.batch

    def set_lengths(self, lengths: list[int]) -> None:
        """Every layer's row b now holds ``lengths[b]`` slots (shortening only: the slots must be there)."""
        for layer in self.lengths:
            for b, n in enumerate(lengths):
                if n > layer[b]:
                    raise ValueError(f"cannot extend row {b} to {n} slots: it holds {layer[b]}")
                layer[b] = n

    # ------------------------------------------------------------------ rollback
    def truncate(self, length: int, row: int | None = None) -> None:
        """Keep the first ``length`` slots of every layer (of one row, or of all rows)."""
        for layer in self.lengths:
            for b in range(self.batch) if row is None else (row,):
                layer[b] = min(layer[b], length)

    def keep(self, starts: list[int], paths: list, rows: list[int] | None = None) -> None:
        """Row rows[i] (default: row i) keeps slots [0, starts[i]) plus ``starts[i] + paths[i]``, in that
        order, on every layer; other rows are untouched.

        paths[i]: offsets (an accepted tree path, root first), a sequence of ints as acceptance gives them
        (read on the host already), or a long tensor. A path 0, 1, .., m - 1 (a chain prefix) moves nothing."""
        rows = list(range(len(starts))) if rows is None else rows
        paths = [tuple(p.tolist()) if isinstance(p, torch.Tensor) else tuple(p) for p in paths]
        moves = []
        for b, start, path in zip(rows, starts, paths):
            if path != tuple(range(len(path))):
                moves.append((b, start, torch.tensor(path, dtype=torch.long)))
        if moves and self.mover is not None:
            self.mover(self, moves)
        elif moves:
            src, dst = path_slots(moves, max(int(p.shape[0]) for _, _, p in moves))
            dev = next(k.device for k in self.keys if k is not None)
            bi = torch.tensor([b for b, _, _ in moves])[:, None].expand_as(src)
            move_slots(self.keys, self.values, bi.to(dev), src.to(dev), dst.to(dev))
        for layer in self.lengths:
            for b, start, path in zip(rows, starts, paths):
                if layer[b] > start:
                    layer[b] = start + len(path)

    # ------------------------------------------------------------------ storage
    def allocate(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device) -> None:
        """Allocate (or keep) the buffers of layers 0 .. layers - 1 now, for a static cache whose first
        writes come from a compiled pass rather than through ``update``."""
        probe = torch.empty(self.batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
        for layer in range(layers):
            self._ensure(layer, probe, 0)

    def _ensure(self, layer_idx: int, key: torch.Tensor, need: int) -> None:
        while len(self.lengths) <= layer_idx:
            self.lengths.append([0] * self.batch)
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is None:
            if need > self.capacity and not self.static:
                self.capacity = max(need, 2 * self.capacity)
            _, heads, _, dim = key.shape
            shape = (self.batch, heads, self.capacity, dim)
            self.keys[layer_idx] = key.new_zeros(shape)
            self.values[layer_idx] = key.new_zeros(shape)
            if self.static_address:
                import torch._dynamo  # only compiled decoding gets here: no cost to import selfspec

                torch._dynamo.mark_static_address(self.keys[layer_idx])
                torch._dynamo.mark_static_address(self.values[layer_idx])
        if need > self.keys[layer_idx].shape[2]:
            if self.static:
                raise ValueError(f"the static KV cache holds {self.capacity} positions; this step needs {need}: "
                                 "give the cache a larger capacity")
            self.capacity = max(need, 2 * self.keys[layer_idx].shape[2])
            for store in (self.keys, self.values):
                old = store[layer_idx]
                grown = old.new_zeros(old.shape[0], old.shape[1], self.capacity, old.shape[3])
                grown[:, :, : old.shape[2]] = old
                store[layer_idx] = grown

    def _write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, rows: "int | list[int] | None"):
        n = key.shape[2]
        lens = self.lengths[layer_idx] if layer_idx < len(self.lengths) else [0] * self.batch
        if rows is None:
            if key.shape[0] != self.batch:
                raise ValueError(f"a forward of {key.shape[0]} rows on a cache of {self.batch}")
            top = max(lens) + n
            self._ensure(layer_idx, key, top)
            K, V, lens = self.keys[layer_idx], self.values[layer_idx], self.lengths[layer_idx]
            if all(x == lens[0] for x in lens):        # equal rows (one row, or a fresh batch): a slice
                K[:, :, lens[0]: lens[0] + n] = key
                V[:, :, lens[0]: lens[0] + n] = value
            else:
                bi, ti = self._write_index(lens, n, key.device)
                K[bi, :, ti] = key.transpose(1, 2)
                V[bi, :, ti] = value.transpose(1, 2)
            for b in range(self.batch):
                lens[b] += n
            return K[:, :, :top], V[:, :, :top]
        if isinstance(rows, list):
            if key.shape[0] != len(rows):
                raise ValueError(f"a forward of {key.shape[0]} rows on a view of {len(rows)}")
            top = max(lens[b] for b in rows) + n
            self._ensure(layer_idx, key, top)
            K, V, lens = self.keys[layer_idx], self.values[layer_idx], self.lengths[layer_idx]
            idx, bi, ti = self._rows_index(rows, [lens[b] for b in rows], n, key.device)
            K[bi, :, ti] = key.transpose(1, 2)
            V[bi, :, ti] = value.transpose(1, 2)
            for b in rows:
                lens[b] += n
            return K[idx, :, :top], V[idx, :, :top]
        b = rows
        end = lens[b] + n
        self._ensure(layer_idx, key, end)
        K, V, lens = self.keys[layer_idx], self.values[layer_idx], self.lengths[layer_idx]
        K[b:b + 1, :, lens[b]: end] = key
        V[b:b + 1, :, lens[b]: end] = value
        lens[b] = end
        return K[b:b + 1, :, :end], V[b:b + 1, :, :end]

    def _write_index(self, lens: list[int], n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(lens), n)
        if key not in self._index:
            self._index.clear()
            bi = torch.arange(self.batch, device=device)[:, None].expand(-1, n)
            ti = torch.tensor(lens, device=device)[:, None] + torch.arange(n, device=device)
            self._index[key] = (bi, ti)
        return self._index[key]


    def _rows_index(self, rows: list[int], lens: list[int], n: int, device):
        """(rows, row index, slot index) for writing n slots after each listed row's own: built once per
        shape and reused by every layer of a forward (they are all at the same lengths)."""
        key = (tuple(rows), tuple(lens), n)
        if key not in self._index:
            self._index.clear()
            idx = torch.tensor(rows, device=device)
            ti = torch.tensor(lens, device=device)[:, None] + torch.arange(n, device=device)
            self._index[key] = (idx, idx[:, None].expand(-1, n), ti)
        return self._index[key]


class RowView:
    """One row of a ``KVCache`` as a one-sequence cache (what ``DecodeState.cache`` holds per row)."""

    def __init__(self, cache: KVCache, row: int):
        self.cache, self.index = cache, row

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.cache._write(layer_idx, key, value, rows=self.index)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        lens = self.cache.lengths
        return lens[layer_idx][self.index] if layer_idx < len(lens) else 0

    def truncate(self, length: int) -> None:
        self.cache.truncate(length, row=self.index)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.layer(index, self.index)


class RowsView:
    """Some rows of a ``KVCache`` as a cache of that many rows (``KVCache.rows``): a batched call for
    the rows still drafting, while the others sit idle. Reads gather the rows (a copy)."""

    def __init__(self, cache: KVCache, rows: list[int]):
        self.cache, self.indices = cache, rows

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.cache._write(layer_idx, key, value, rows=self.indices)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        lens = self.cache.lengths
        return max(lens[layer_idx][b] for b in self.indices) if layer_idx < len(lens) else 0


class StaticStorage:
    """The buffers of static caches, kept and handed to every later cache of the same (rows, capacity).

    A compiled static pass writes the cache in place. On CUDA, ``torch.compile``'s CUDA graphs take a
    pass that mutates its inputs only when those inputs sit at static addresses: buffers allocated
    afresh for every generate call would make it run without graphs (it says "skipping cudagraphs due
    to mutated inputs"). So the static step and the eagle head keep their buffers here, marked as static
    addresses (``torch._dynamo.mark_static_address``, unguarded: a new address re-records a graph, it
    never recompiles), and each decode reuses them: prefill overwrites what it reads, and whatever
    lies beyond a row's length is stale and masked, as in any static cache.

    One cache uses a set of buffers at a time: while the cache last handed out for a shape is in use
    (another decode still running, or a timing run inside one), a request gets fresh buffers. A cache is
    in use until its user hands it back (``release``, where a decode or a warm-up ends) or it is
    garbage; handing back is what counts, since something unrelated (a traceback, a compiler's state)
    may keep a finished cache's object alive for a while."""

    def __init__(self, *, static_address: bool = True):
        self.static_address = static_address
        self._buffers: dict[tuple[int, int], tuple[list, list]] = {}
        self._user: dict[tuple[int, int], "weakref.ref[KVCache]"] = {}

    def cache(self, batch: int, capacity: int) -> KVCache:
        """A static cache of ``batch`` rows and ``capacity`` positions on the kept buffers of that shape."""
        shape = (batch, capacity)
        user = self._user.get(shape)
        if user is not None and user() is not None:       # in use: this cache gets buffers of its own
            return KVCache(batch, capacity=capacity, static_address=self.static_address)
        if shape not in self._buffers:   # capacities only grow (``StaticStep.reserve``): smaller ones are done with
            for old in [s for s in self._buffers if s[0] == batch and s[1] < capacity]:
                del self._buffers[old]
                self._user.pop(old, None)
        buffers = self._buffers.setdefault(shape, ([], []))
        cache = KVCache(batch, capacity=capacity, storage=buffers, static_address=self.static_address)
        self._user[shape] = weakref.ref(cache)
        return cache

    def release(self, cache: KVCache) -> None:
        """``cache`` (one this storage handed out) is done with: the next request of its shape gets its
        buffers. A cache that had buffers of its own, or was released already, changes nothing."""
        for shape, user in list(self._user.items()):
            if user() is cache:
                del self._user[shape]


def path_slots(moves: list[tuple[int, int, torch.Tensor]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) (len(moves), width) on the host for ``KVCache.keep``'s moves (row, start, path offsets):
    each path's slots and where they go. Shorter paths repeat their last offset, so the extra writes land
    past the row's new length."""
    src = torch.stack([torch.cat([p, p[-1:].expand(width - p.shape[0])]) + s for _, s, p in moves])   # host tensors
    dst = torch.stack([torch.arange(width) + s for _, s, _ in moves])
    return src, dst


def move_slots(keys: list, values: list, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Slots src[i] of row rows[i] to slots dst[i] (all (R, width)), in every allocated layer's keys and
    values, in place: the rollback's moves, eagerly or as a static step's one pass (``StaticStep.move``)."""
    for k, v in zip(keys, values):
        if k is None:
            continue
        for buf in (k, v):
            buf[rows, :, dst] = buf[rows, :, src]     # the right side is gathered (copied) first


class SlotWriter:
    """What layers call ``cache.update`` on inside a static pass (``step.py``): write each row's new
    slots at tensor positions ``slots`` (B, n) of rows ``rows`` (B, n), in place, and read the whole
    capacity (the pass's mask hides what a query may not see). Host-side lengths are the caller's."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: torch.Tensor, slots: torch.Tensor):
        self.keys, self.values, self.rows, self.slots = keys, values, rows, slots

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        K, V = self.keys[layer_idx], self.values[layer_idx]
        K[self.rows, :, self.slots] = key.transpose(1, 2)      # (B, n, kv_heads, head_dim) into (B, kv_heads, C, d)
        V[self.rows, :, self.slots] = value.transpose(1, 2)
        return K, V

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def new_cache(batch: int = 1, capacity: int | None = None) -> KVCache:
    return KVCache(batch, capacity=capacity)


def seq_len(cache, layer: int = 0) -> int:
    return cache.get_seq_length(layer)


def truncate(cache: KVCache, new_len: int) -> None:
    cache.truncate(new_len)


def keep(cache: KVCache, start: int, indices: torch.Tensor) -> None:
    """One row: keep slots [0, start) plus ``start + indices`` of every layer, in that order."""
    cache.keep([start], [indices])
