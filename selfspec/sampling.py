"""Logits -> probabilities, identically for target and draft.

Rejection sampling is lossless for the *processed* target distribution, so temperature, top-k
and top-p must be applied the same way to p (target) and q (draft). Order as in transformers:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling (got {self.temperature}); use do_sample=False for greedy")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0 (got {self.top_k})")


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop the low tail whose total mass is <= 1 - top_p; the most likely token always survives.
        drop_sorted = cum <= (1 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of (..., V) probabilities -> (...) long."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def pick_candidates(
    scores: torch.Tensor, width: int, *, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """(R, V) draft logits (greedy) or probabilities (sampling) -> (R, width) candidate tokens, in rank order.

    Greedy drafts the top-``width`` tokens. Sampling draws ``width`` tokens *without replacement*
    from q: that is what makes trying siblings one after another lossless (see verify.py). A row
    with fewer than ``width`` non-zero tokens is padded by repeating its last draw; the acceptance
    rule skips candidates whose remaining draft mass is zero.
    """
    if not params.do_sample:
        return torch.topk(scores, width, dim=-1).indices
    rows = []
    for row in scores:  # R is the tree depth or less: a short loop
        take = min(width, int((row > 0).sum()))
        draws = torch.multinomial(row, take, replacement=False, generator=generator)
        rows.append(torch.cat([draws, draws[-1:].expand(width - take)]))
    return torch.stack(rows)
