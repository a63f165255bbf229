"""What drafters share besides the contract (``core.types.Drafter``): candidate picking, tree layout, checks."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..core.backbone import Backbone
from ..core.sampling import pick_candidates, probs_from_logits
from ..core.tree import Tree, build_tree, prune
from ..core.types import DecodeState
from ..settings import COPY_ACCEPT_FIRST, COPY_ACCEPT_NEXT


@dataclass(frozen=True)
class Candidates:
    tokens: torch.Tensor          # (R, width) token ids in rank order, one row per depth
    q: torch.Tensor | None        # (R, V) full-vocabulary draft probs (drawn when sampling), else None
    conf: torch.Tensor            # (R, width) the draft's confidence in each candidate (see below)


def row_candidates(
    logits: torch.Tensor, width: int, *, vocab: torch.Tensor | None, vocab_size: int, state: DecodeState, draw: bool
) -> Candidates:
    """(R, V_draft) draft logits -> ``width`` candidates per row, mapped from the draft vocabulary back to
    token ids: the top ``width``, or when sampling with ``draw``, ``width`` draws without replacement.

    When sampling, a draw from q is accepted with chance sum min(p, q), a certain token only with its
    own p; but a draft's top few tokens cover more of p than as many draws do where q is flatter than p
    or its siblings overlap, and they can be cut by their own chances. Medusa proposes its likeliest
    tokens (``draw=False``, as EAGLE does); early exit and the draft model, whose q is a model's own
    next-token distribution, draw. The likeliest carry no q (``q=None``): each is a point mass, accepted
    by ``accept.point_accept_tree``, and any cut of them stays exact.

    conf, which ``tree.prune`` and width fitting use to drop unlikely candidates: each candidate's draft
    probability (after the sampling processors when sampling); when drawing, the row's largest
    probability for every candidate of the row: whether a row is proposed at all must not depend on
    which tokens were drawn from it (the acceptance rule assumes the candidates are plain draws from q),
    so the whole row stands or falls together, decided by q alone.
    """
    q = None
    if not state.params.do_sample:
        cand = pick_candidates(logits, width, params=state.params, generator=None)
        conf = logits.float().softmax(-1).gather(1, cand)
    else:
        q_small = probs_from_logits(logits, state.params)
        if draw:
            cand = pick_candidates(q_small, width, params=state.params, generator=state.generator)
            q = full_vocab(q_small, vocab, vocab_size)
            conf = q_small.max(-1, keepdim=True).values.expand(-1, width)
        else:
            cand = q_small.topk(width, dim=-1).indices
            conf = q_small.gather(1, cand)
    return Candidates(tokens=cand if vocab is None else vocab[cand], q=q, conf=conf)


def full_vocab(q: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """(R, V_draft) draft probabilities -> (R, V) over the whole vocabulary (zero outside the draft's)."""
    return q if vocab is None else q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)


def layout(tree: Tree, root, cand: torch.Tensor) -> torch.Tensor:
    """Node i at depth d and rank r gets candidate r of row d - 1: cand (..., depth, width) -> (..., n)
    tokens, root first (root: one value, or a (...) tensor of them: a row's each).

    Medusa and early exit draft one distribution per depth (Medusa's head d, or the chain node at
    depth d - 1), so row d - 1 is the q a depth-d node was drawn from (``Draft.q_rows``' default).
    """
    body = cand[(..., *tree.table_index)]
    root = torch.as_tensor(root, dtype=body.dtype, device=body.device).expand(body.shape[:-1])
    return torch.cat([root[..., None], body], dim=-1)


def prior_chance(depth: int) -> float:
    """A node's chance when no draft distribution gives one: the copied-token prior at its depth
    (settings.COPY_ACCEPT_*; the root's 1)."""
    return 1.0 if depth == 0 else COPY_ACCEPT_FIRST * COPY_ACCEPT_NEXT ** (depth - 1)


def layout_path_p(tree: Tree, conf: torch.Tensor) -> torch.Tensor:
    """(..., n) each node's path probability, from ``conf`` (..., depth, width) laid out as ``layout`` lays
    out candidates (node at depth d and rank r: conf[..., d - 1, r]); the root's is 1."""
    c = conf[(..., *tree.table_index)].float()
    c = torch.cat([c.new_ones(*c.shape[:-1], 1), c], dim=-1)
    return (c.clamp(min=1e-30).log() @ tree.path_weights.to(c.device).T).exp()


def check_threshold(threshold: float) -> float:
    threshold = float(threshold)
    if not 0 <= threshold < 1:
        raise ValueError(f"threshold must be in [0, 1) (got {threshold}): a draft path probability below it is not proposed")
    return threshold


def check_gate(gate: float) -> float:
    gate = float(gate)
    if gate < 0:
        raise ValueError(f"gate must be >= 0 (got {gate}): the expected accepted tokens below which nothing is proposed")
    return gate


def check_lookup(lookup: int) -> int:
    if isinstance(lookup, bool) or not isinstance(lookup, int) or lookup < 0:
        raise ValueError(f"lookup must be a whole number >= 0 (got {lookup!r}): the most context tokens grafted per step, 0 = off")
    return lookup


def pruned(tree: Tree, conf: torch.Tensor | list[list[float]], threshold: float, gate: float = 0.0) -> Tree:
    """``tree`` cut where the draft is unsure (``tree.prune``: node threshold, then whole-tree gate).

    conf: (depth, width) per-candidate confidences, one row per depth (``Candidates.conf``), or the same
    as lists the host holds already (then nothing is read)."""
    if threshold <= 0 and gate <= 0:
        return tree
    if isinstance(conf, torch.Tensor):
        nodes = layout(tree, 1.0, conf)
    else:   # node i at depth d and rank r reads conf[d - 1][r], as ``layout`` lays candidates out
        _, depths, ranks = tree.lists
        nodes = [1.0] + [conf[d - 1][r] for d, r in zip(depths[1:], ranks[1:])]
    return build_tree(prune(tree, nodes, threshold, gate), str(tree.parents.device))


def tree_width(tree: Tree) -> int:
    return max((tree.width_at(d) for d in range(1, tree.depth + 1)), default=1)


def draft_head(backbone: Backbone, vocab: torch.Tensor | None):
    """(.., H) -> (.., V_draft): the LM-head rows a draft scores against, all of them or a frequent-token subset."""
    weight, bias = backbone.lm_head.weight, backbone.lm_head.bias
    if vocab is not None:
        weight, bias = weight.index_select(0, vocab), None if bias is None else bias.index_select(0, vocab)
    return functools.partial(F.linear, weight=weight, bias=bias)
