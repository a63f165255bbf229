"""Warm start for train-heads (``--init``): begin from a trained heads directory instead of fresh heads.

The new heads must have the init's shape, except that they may grow what the init lacks, zero-initialised
so that training begins from exactly what the init predicts: Medusa heads an extra MLP, an eagle head
more auxiliary layers (its ``fc`` gets zero columns for the new layers' features). An eagle head may
also read fewer auxiliary layers than its init, as long as they share one: the dropped layers' ``fc``
columns go, the rest keep their weights, and training recovers what the dropped features carried
(this is how a head over 4 layers becomes one over the 3 that serving engines load). The init's
draft vocabulary and held-out split are kept (``split.warm_split``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..heads import Heads, head_widths
from .checkpoint import STATE_FILE


def load_init(path: str, *, kind: str, model) -> Heads:
    """The heads in ``path``, with the fp32 weights of its trainer state when it has one
    (model.safetensors may be stored in float16). Their shape is checked once this run's heads exist."""
    from ..core.backbone import config_fingerprint
    from ..heads import load_heads

    heads = load_heads(path, expect_kind=kind, fingerprint=config_fingerprint(model.config), model=model)
    state = Path(path) / STATE_FILE
    if state.is_file():
        heads.module.load_state_dict(torch.load(state, map_location="cpu", weights_only=True)["heads"])
    heads.module.float()
    return heads


def check_init_shape(init: Heads, mine: Heads, path: str) -> None:
    """Refuse an init whose heads differ from this run's in anything but MLPs this run adds."""
    keys = ("num_heads", "token_input", "exit_layer", "adapter", "intermediate_size")
    diffs = [f"{k} {getattr(init.config, k)} (this run: {getattr(mine.config, k)})" for k in keys
             if getattr(init.config, k) != getattr(mine.config, k)]
    n = mine.config.num_heads
    old, new = head_widths(init.config.head_mlp, n), head_widths(mine.config.head_mlp, n)
    if any(o and o != w for o, w in zip(old, new)):  # growing a head (0 -> w) is fine; changing a trained MLP is not
        diffs.append(f"head_mlp {init.config.head_mlp} (this run: {mine.config.head_mlp})")
    if mine.config.kind == "eagle" and not set(init.config.aux_layers) & set(mine.config.aux_layers):
        diffs.append(f"aux_layers {init.config.aux_layers} (this run: {mine.config.aux_layers}; "
                     "a warm start must keep at least one of the init's layers)")
    if diffs:
        raise ValueError(f"--init {path} has {', '.join(diffs)}: pass matching flags, or drop --init")


def remap_fc(weight: torch.Tensor, old_aux: list[int], new_aux: list[int]) -> torch.Tensor:
    """An eagle ``fc`` weight (H, A*H) over ``old_aux`` -> (H, A'*H) over ``new_aux``: each layer in both
    keeps its block, moved to its new place; layers only in ``new_aux`` get zero blocks, layers only in
    ``old_aux`` are dropped."""
    H = weight.shape[0]
    out = weight.new_zeros(H, len(new_aux) * H)
    for i, layer in enumerate(old_aux):
        if layer in new_aux:
            j = new_aux.index(layer)
            out[:, j * H:(j + 1) * H] = weight[:, i * H:(i + 1) * H]
    return out


def load_grown(module: torch.nn.Module, init: Heads, aux_layers: list[int] | None = None) -> None:
    """Copy ``init``'s weights into ``module``, which may give heads an extra MLP that ``init`` lacks, or
    an eagle head more auxiliary layers (``aux_layers``, this run's): left zero-initialised, so the warm
    start begins with exactly what ``init`` predicts. An eagle head over fewer layers loses the dropped
    layers' ``fc`` columns (``remap_fc``)."""
    state = dict(init.module.state_dict())
    if aux_layers is not None and list(aux_layers) != list(init.config.aux_layers):
        state["fc.weight"] = remap_fc(state["fc.weight"], list(init.config.aux_layers), list(aux_layers))
    missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or any(".mlp." not in k for k in missing):
        raise ValueError(f"cannot warm-start from heads of another shape (missing {missing[:2]}, unexpected {unexpected[:2]})")
