"""Logits -> probabilities, identically for target and draft.

Rejection sampling is lossless for the *processed* target distribution, so temperature, top-k
and top-p must be applied the same way to p (target) and q (draft). Order as in transformers:
the repetition penalty, then temperature, then top-k, then top-p, then min-p.

The repetition penalty (``penalize_repeats``) is applied to the target's logits only, at every tree
node with the tokens that node's own text holds (the context's and those on its path), as
transformers applies it to the one sequence it extends; greedy then takes the argmax of the
penalised logits. A draft needs no penalty for exactness (any q keeps rejection sampling lossless).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off
    min_p: float = 0.0      # 0.0 = off: tokens below min_p x the top token's probability are dropped
    repetition_penalty: float = 1.0   # 1.0 = off; greedy too

    def __post_init__(self):
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (got {self.repetition_penalty}); 1.0 is off")
        if self.do_sample:
            if not 0 < self.temperature < math.inf:
                raise ValueError(f"temperature must be a finite number > 0 when sampling (got {self.temperature}); use do_sample=False for greedy")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
            if self.top_k < 0:
                raise ValueError(f"top_k must be >= 0 (got {self.top_k})")
            if not 0 <= self.min_p <= 1:
                raise ValueError(f"min_p must be in [0, 1] (got {self.min_p})")


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p, min-p."""
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
    if params.min_p > 0:   # the most likely token always survives (min_p <= 1)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits.softmax(-1)


def penalize_repeats(logits: torch.Tensor, context: Sequence[int], penalty: float,
                     tokens: torch.Tensor | None = None, ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """(n, V) logits -> float32 logits with transformers' repetition penalty (a seen token's logit divided
    by ``penalty`` where positive, multiplied where negative). Row i predicts what follows ``context``
    (the committed tokens, prompt included) and, in a tree, the path to node i: ``tokens`` (n,) the
    nodes' tokens, ``ancestors`` (n, n) [i, j] = j is i or an ancestor of i. Without a tree every row
    reads ``context`` alone."""
    logits = logits.float()
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    ids = torch.as_tensor(list(context), dtype=torch.long, device=logits.device)
    seen[:, ids[ids < logits.shape[-1]]] = True   # ids past the LM head's rows (a padded embedding) cannot repeat
    if tokens is not None:
        node, anc = ancestors.to(logits.device).nonzero(as_tuple=True)
        seen[node, tokens.to(logits.device)[anc]] = True
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def target_logits(logits: torch.Tensor, params: SamplingParams, context: Sequence[int], *, tokens=None,
                  tree=None, eos: Collection[int] = (), eos_until: int = 0) -> torch.Tensor:
    """(n, V) target logits after each node -> what transformers' logits processors make of them there, before
    temperature and the cuts: the repetition penalty for the tokens of each node's own text (``context``, the
    committed tokens, plus its path: ``penalize_repeats``), and the ``eos`` tokens masked at the nodes of
    depth below ``eos_until`` (min_new_tokens / min_length: the text may not end there). Without a tree
    (``tokens``, ``tree``), rows read ``context`` alone at depth 0."""
    if params.repetition_penalty != 1.0:
        logits = penalize_repeats(logits, context, params.repetition_penalty, tokens,
                                  None if tree is None else tree.ancestors)
    if eos_until > 0 and eos:
        dev = logits.device
        depth = torch.zeros(logits.shape[0], dtype=torch.long, device=dev) if tree is None else tree.depths.to(dev)
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=dev)
        banned[[t for t in eos if t < logits.shape[-1]]] = True
        logits = logits.float().masked_fill((depth < eos_until)[:, None] & banned[None], float("-inf"))
    return logits


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
    support = (scores > 0).sum(-1).tolist()   # (one read for every row)
    for row, nonzero in zip(scores, support):  # R is the tree depth or less: a short loop
        take = min(width, nonzero)
        draws = torch.multinomial(row, take, replacement=False, generator=generator)
        rows.append(torch.cat([draws, draws[-1:].expand(width - take)]))
    return torch.stack(rows)
