"""KV cache rollback with explicit units.

The cache is transformers' own ``DynamicCache`` (passed through the model's public forward
arguments); this module only adds the two operations speculative decoding needs after a step:

* ``truncate(cache, new_len)``: keep the first ``new_len`` positions of every layer (a chain
  drafter's cache after rejection);
* ``keep(cache, start, indices)``: keep positions ``[0, start)`` plus ``start + indices`` of every
  layer, in that order (compaction to the accepted path of a tree).

Layers may be at different lengths mid-step (early exit writes layers < E first); both operations
act on each layer independently and leave every layer at the same length.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    return DynamicCache()


def seq_len(cache: DynamicCache, layer: int = 0) -> int:
    if layer >= len(cache.layers):
        return 0
    return cache.layers[layer].get_seq_length()


def truncate(cache: DynamicCache, new_len: int) -> None:
    for layer in cache.layers:
        if layer.get_seq_length() > new_len:
            layer.keys = layer.keys[..., :new_len, :]
            layer.values = layer.values[..., :new_len, :]


def keep(cache: DynamicCache, start: int, indices: torch.Tensor) -> None:
    """indices: (m,) long, offsets from ``start`` of the positions to keep (e.g. an accepted tree path)."""
    indices = indices.to(torch.long)
    m = indices.shape[0]
    # A path 0, 1, ..., m - 1 (chain prefix) is a plain truncation: no gather, no copy.
    if bool((indices == torch.arange(m, device=indices.device)).all()):
        truncate(cache, start + m)
        return
    for layer in cache.layers:
        if layer.get_seq_length() <= start:
            continue
        idx = (indices + start).to(layer.keys.device)
        # Write the kept rows into place rather than concatenating: one small copy per layer.
        layer.keys[..., start : start + m, :] = layer.keys.index_select(-2, idx)
        layer.values[..., start : start + m, :] = layer.values.index_select(-2, idx)
        layer.keys = layer.keys[..., : start + m, :]
        layer.values = layer.values[..., : start + m, :]
