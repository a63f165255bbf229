"""The frozen backbone's side of training: the LM-head view the losses score with, and the feature cache.

With the backbone frozen, its forward over a sequence is the same in every epoch, so it is done
once up front and kept on disk under $SELFSPEC_HOME/features; epochs then cost only the trained
module. Medusa heads, exit heads and the distilled draft share one cache.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..core.backbone import Backbone
from .checkpoint import atomic_torch_save
from .split import Sequence, collate, length_batches

log = logging.getLogger(__name__)


@dataclass
class Target:
    """The frozen backbone pieces training needs; built once per run."""

    backbone: Backbone
    vocab: torch.Tensor | None   # (V_sub,) or None
    weight: torch.Tensor         # (V_sub, H) LM-head rows, detached
    exit_layer: int | None


def target_view(model, *, vocab: torch.Tensor | None, exit_layer: int | None) -> Target:
    bb = Backbone(model)
    w = bb.lm_head.weight.detach()
    if vocab is not None:
        vocab = vocab.to(w.device)
        w = w.index_select(0, vocab)
    return Target(backbone=bb, vocab=vocab, weight=w, exit_layer=exit_layer)


@dataclass
class FeatureCache:
    """The frozen backbone's hidden states for every sequence, computed once (float16, CPU).

    With the backbone frozen, its forward is the same in every epoch and dominates the cost of a
    step on CPU (the heads are small), so it is done once and reused by every epoch and by both
    head kinds (the cache holds the final post-norm states and the states after layer E).
    """

    final: list[torch.Tensor]   # per sequence (L_i, H) post-norm last hidden state
    exit: list[torch.Tensor]    # per sequence (L_i, H) after layer E

    def gather(self, ids: list[int], *, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (B, L, H) float32 tensors for sequences ``ids`` (padding rows are zeros)."""
        def pad(rows):
            L = max(r.shape[0] for r in rows)
            out = torch.zeros(len(rows), L, rows[0].shape[1])
            for i, r in enumerate(rows):
                out[i, : r.shape[0]] = r.float()
            return out.to(device)
        return pad([self.final[i] for i in ids]), pad([self.exit[i] for i in ids])


FEATURE_CHUNK = 256  # sequences per cache file: appending data to a dataset costs only the new chunks


def feature_cache_path(model, seqs: list[Sequence], *, exit_layer: int, dtype: str = "float32") -> Path:
    """Where the features of these sequences live under $SELFSPEC_HOME (keyed by model, data, E and dtype)."""
    import hashlib

    from ..core.backbone import config_fingerprint
    from ..loading import selfspec_home

    h = hashlib.sha1(f"{config_fingerprint(model.config)}:{exit_layer}:{dtype}".encode())
    for s in seqs:
        h.update(s.ids.numpy().tobytes())
        h.update(str(s.response_start).encode())
    return selfspec_home() / "features" / f"{h.hexdigest()[:20]}.pt"


FEATURE_DTYPES = ("float32", "bfloat16")


@torch.no_grad()
def extract_features(model, seqs: list[Sequence], *, exit_layer: int, batch_size: int, device,
                     dtype: str = "float32", progress: bool = True) -> FeatureCache:
    """One no-grad backbone pass over ``seqs``, cached on disk in chunks of FEATURE_CHUNK sequences.

    Each chunk is keyed by its own content, so a dataset that grew by new shards re-uses every
    earlier chunk and computes only the new ones. ``dtype="bfloat16"`` runs the pass under bfloat16
    autocast (faster on a CPU with BF16 instructions or a GPU; the features are stored as float16 either
    way). Batches are length-sorted within a chunk, so there is little padding.
    """
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(FEATURE_DTYPES)} (got {dtype!r})")
    chunks = [seqs[lo : lo + FEATURE_CHUNK] for lo in range(0, len(seqs), FEATURE_CHUNK)]
    paths = [feature_cache_path(model, c, exit_layer=exit_layer, dtype=dtype) for c in chunks]
    todo = sum(len(c) for c, p in zip(chunks, paths) if not p.is_file())
    if todo:
        log.info("backbone features: %d of %d sequences to compute (%s)", todo, len(seqs), dtype)
    inner = Backbone(model).model.model
    device = torch.device(device)
    final: list = []
    exit_: list = []
    with tqdm(total=todo, desc="backbone features", unit="seq", disable=not progress or not todo, file=sys.stderr) as bar:
        for chunk, path in zip(chunks, paths):
            if path.is_file():
                saved = torch.load(path, map_location="cpu", weights_only=True)
                final += saved["final"]
                exit_ += saved["exit"]
                continue
            f_chunk: list = [None] * len(chunk)
            e_chunk: list = [None] * len(chunk)
            for idx in length_batches(chunk, batch_size):
                b = collate([chunk[i] for i in idx], lead=0)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                    out = inner(input_ids=b.input_ids.to(device), attention_mask=b.attention_mask.to(device),
                                output_hidden_states=True, use_cache=False)
                for j, i in enumerate(idx):
                    n = len(chunk[i].ids)
                    f_chunk[i] = out.last_hidden_state[j, :n].to("cpu", torch.float16)
                    e_chunk[i] = out.hidden_states[exit_layer][j, :n].to("cpu", torch.float16)
                bar.update(len(idx))
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_torch_save({"final": f_chunk, "exit": e_chunk}, path)
            final += f_chunk
            exit_ += e_chunk
    return FeatureCache(final=final, exit=exit_)
