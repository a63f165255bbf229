"""Self-distillation losses for draft heads: pure functions, tensors in, tensors out.

Position convention (the one the target itself uses): ``target_logits[:, s]`` is the target's
distribution for the token at position ``s + 1``.

* Medusa head k (0-based) reads the hidden state at position t, where the target's own next
  token t + 1 is already known at decode time, and guesses the token at t + k + 2. Its teacher
  is therefore the target row ``s = t + k + 1``::

      head_logits[:, t, k]  <->  target_logits[:, t + k + 1]

* The exit head reads layer E at position t and imitates the final layer at the same t.

``mask`` (B, T) marks the *target rows* that are training signal (response positions). A head
term at t counts when its target row ``t + k + 1`` (``t`` for exit) exists and is marked.

Restricted vocabulary: heads may score only a subset ``vocab`` (V_sub,) of token ids (the draft
vocabulary; see ``selfspec.training.split.frequent_vocab``). The teacher is then the target's
distribution *restricted to the subset and renormalised*, i.e. the softmax of the target logits
over those columns. Why renormalise rather than keep the missing mass: the heads cannot propose
an out-of-subset token anyway, so the best they can do is rank the in-subset tokens as the target
does, and the renormalised KL is zero exactly when they do. (It also means the target logits can
be computed on the subset alone, without ever materialising full-vocabulary logits.) Accuracies
are likewise measured against the target's argmax *within the subset*: an upper bound on the
agreement with the full-vocabulary argmax, equal to it whenever the target's choice is frequent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass
class HeadLoss:
    """A loss and per-head diagnostics. Per-head tensors have shape (K,) (K = 1 for the exit head)."""

    loss: torch.Tensor   # () weighted sum over heads of each head's mean; differentiable
    kl: torch.Tensor     # (K,) mean KL(target || head) per head over its valid positions (detached)
    top1: torch.Tensor   # (K,) fraction of valid positions where head argmax == target argmax
    top5: torch.Tensor   # (K,) fraction where the target argmax is in the head's top 5
    count: torch.Tensor  # (K,) number of valid positions (weights for averaging over batches)
    terms: torch.Tensor | None = None  # (K,) each head's weighted loss *sum* (loss = sum(terms / count)); differentiable

    def normalised(self, counts: torch.Tensor) -> torch.Tensor:
        """The loss with each head's sum divided by ``counts`` (K,) instead of this batch's own counts:
        with the counts of the whole global batch (all processes), every process's share adds up to
        exactly the single-process loss of that batch."""
        if self.terms is None:
            raise ValueError("this loss carries no per-head sums")
        return (self.terms / counts.to(self.terms.device).clamp(min=1)).sum()


def restrict_target(target_logits: torch.Tensor, vocab: torch.Tensor | None, v_sub: int) -> torch.Tensor:
    """Target logits over the head's columns: (..., V) -> (..., V_sub), or unchanged if already V_sub wide."""
    if vocab is None or target_logits.shape[-1] == v_sub:
        if target_logits.shape[-1] != v_sub:
            raise ValueError(f"target logits have {target_logits.shape[-1]} columns but the heads score {v_sub}: pass vocab=")
        return target_logits
    return target_logits.index_select(-1, vocab.to(target_logits.device))


def to_subset_ids(tokens: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Full-vocabulary ids -> column indices in ``vocab`` (sorted ids); -1 for tokens not in it."""
    if vocab is None:
        return tokens
    vocab = vocab.to(tokens.device)
    pos = torch.searchsorted(vocab, tokens).clamp(max=vocab.numel() - 1)
    return torch.where(vocab[pos] == tokens, pos, torch.full_like(pos, -1))


def _pair_stats(head: torch.Tensor, target: torch.Tensor, hard: torch.Tensor | None):
    """head, target: (N, V) logits at matched positions; hard: (N,) subset ids or -1. -> sums (kl, ce, top1, top5)."""
    log_q = F.log_softmax(head.float(), dim=-1)
    log_p = F.log_softmax(target.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).sum()  # KL(p || q), p = target, q = head
    ce = head.new_zeros((), dtype=torch.float32)
    if hard is not None:
        keep = hard >= 0  # a token outside the draft vocabulary has no column to push up
        if keep.any():
            ce = -log_q[keep].gather(-1, hard[keep, None]).sum()
    with torch.no_grad():
        want = target.argmax(-1)  # (N,)
        k = min(5, head.shape[-1])
        top = head.topk(k, dim=-1).indices  # (N, k)
        top1 = (top[:, 0] == want).sum()
        top5 = (top == want[:, None]).any(-1).sum()
    return kl, ce, top1, top5


def medusa_loss(
    head_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    weight_decay_base: float = 0.8,
    hard_tokens: torch.Tensor | None = None,
    hard_weight: float = 0.0,
    vocab: torch.Tensor | None = None,
) -> HeadLoss:
    """Sum over heads k of ``weight_decay_base**k * (mean KL + hard_weight * mean CE)``.

    head_logits (B, T, K, V_sub); target_logits (B, T, V) or (B, T, V_sub); mask (B, T) bool over
    target rows. ``hard_tokens`` (B, T) full-vocabulary ids aligned with the target rows:
    ``hard_tokens[:, s]`` is the token that actually followed position s (``input_ids[:, s + 1]``),
    so it gets the same shift as ``target_logits``. Heads without a valid position contribute 0.
    """
    B, T, K, V = head_logits.shape
    target = restrict_target(target_logits, vocab, V)
    hard = to_subset_ids(hard_tokens, vocab) if hard_tokens is not None and hard_weight > 0 else None
    loss = head_logits.new_zeros((), dtype=torch.float32)
    terms = [head_logits.new_zeros((), dtype=torch.float32) for _ in range(K)]
    stats = torch.zeros(4, K)  # kl, top1, top5, count
    for k in range(K):
        shift = k + 1
        if T <= shift:
            continue
        valid = mask[:, shift:]  # (B, T - shift): target row t + k + 1 is marked
        n = int(valid.sum())
        if n == 0:
            continue
        h = head_logits[:, : T - shift, k][valid]  # (N, V_sub) head k at t
        p = target[:, shift:][valid]                # (N, V_sub) target row t + k + 1
        y = hard[:, shift:][valid] if hard is not None else None
        kl, ce, top1, top5 = _pair_stats(h, p, y)
        terms[k] = weight_decay_base**k * (kl + hard_weight * ce)
        loss = loss + terms[k] / n
        stats[:, k] = torch.stack([kl.detach().cpu(), top1.cpu().float(), top5.cpu().float(), torch.tensor(float(n))])
    count = stats[3]
    denom = count.clamp(min=1)
    return HeadLoss(loss=loss, kl=stats[0] / denom, top1=stats[1] / denom, top5=stats[2] / denom, count=count,
                    terms=torch.stack(terms))


def exit_loss(
    exit_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    hard_tokens: torch.Tensor | None = None,
    hard_weight: float = 0.0,
    vocab: torch.Tensor | None = None,
) -> HeadLoss:
    """Mean KL(final layer || exit) over marked positions, at the *same* position (no shift).

    exit_logits (B, T, V_sub); target_logits (B, T, V) or (B, T, V_sub); mask (B, T) bool;
    ``hard_tokens`` as in :func:`medusa_loss`. Returns per-head tensors of shape (1,).
    """
    V = exit_logits.shape[-1]
    target = restrict_target(target_logits, vocab, V)
    n = int(mask.sum())
    if n == 0:
        zero = torch.zeros(1)
        return HeadLoss(loss=exit_logits.sum() * 0.0, kl=zero, top1=zero, top5=zero, count=zero,
                        terms=(exit_logits.sum() * 0.0).reshape(1))
    hard = None
    if hard_tokens is not None and hard_weight > 0:
        hard = to_subset_ids(hard_tokens, vocab)[mask]
    kl, ce, top1, top5 = _pair_stats(exit_logits[mask], target[mask], hard)
    loss = (kl + hard_weight * ce) / n
    return HeadLoss(loss=loss, kl=kl.detach().cpu().reshape(1) / n, top1=top1.cpu().float().reshape(1) / n,
                    top5=top5.cpu().float().reshape(1) / n, count=torch.tensor([float(n)]),
                    terms=(kl + hard_weight * ce).reshape(1))
