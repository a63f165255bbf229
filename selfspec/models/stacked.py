"""Several projections of one input as one product, for the draft modules' decoding calls.

A one-layer draft head runs a handful of small products per call, and in eager decoding each costs
about as much to launch as to compute: stacking the weights of products that read the same input
(q, k and v; gate and up; the Medusa heads) makes one launch of them. Training and compiled passes run
the modules as written (inductor fuses them itself), so autograd sees the parameters one by one.
"""

from __future__ import annotations

import torch
from torch import nn


def decoding() -> bool:
    """Whether a call may use ``stacked`` weights: eager and without autograd."""
    return not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def stacked(owner: nn.Module, name: str, tensors: "list[torch.Tensor] | tuple[torch.Tensor, ...]", make=torch.cat):
    """``make(tensors)`` (default ``torch.cat``), kept on ``owner`` under ``name`` and made again whenever one
    of them changes (moved, reloaded, or trained in place: its storage or version counter moves)."""
    key = tuple((t.data_ptr(), t._version) for t in tensors)
    kept = owner.__dict__.setdefault("_stacked", {})
    hit = kept.get(name)
    if hit is None or hit[0] != key:
        hit = kept[name] = (key, make(tensors))
    return hit[1]
