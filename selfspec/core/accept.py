"""Acceptance rules: pure functions of tensors.

Convention (Leviathan et al. 2023): **p** is the target model's distribution, **q** the draft's.
Both are already processed by ``sampling.probs_from_logits`` with the same parameters.

Node 0 of a tree is the root (the pending token, already chosen by the target). Target row i
(``p[i]`` or ``target_argmax[i]``) is the target's prediction for the token *after* node i, so
node i is correct when its token matches its parent's row. ``num_accepted`` counts accepted draft
nodes, not the root and not the bonus token; the step emits ``num_accepted + 1`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tree import Tree


@dataclass(frozen=True)
class Accepted:
    path: tuple[int, ...]     # accepted node ids, root first (len = num_accepted + 1)
    bonus: int                # the token the target adds after the last accepted node
    tokens: tuple[int, ...]   # what the step commits: the accepted nodes' tokens (root excluded), then the bonus
    depth: int | None = None  # the verified tree's depth where the rule read it (statistics); None: not read

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def greedy_accept_rows(tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor,
                       offsets: Sequence[int]) -> list[Accepted]:
    """Per row: the longest root path whose every token equals the target's argmax at its parent (the
    first such node in node order where several are deepest).

    A step's trees flat (``types.Drafts``): row b's nodes are offsets[b] .. offsets[b + 1] - 1 of tokens,
    parents (within the row; a root's -1) and target_argmax (N,) long. ONE host read for all rows, then
    a walk over each tree's nodes in order (a parent comes before its children), which also gives each
    tree's depth (``Accepted.depth``, for the loop's statistics, so reading it costs nothing more). Exact:
    the committed tokens are the ones plain greedy decoding would produce, whatever the draft proposed.
    """
    dev = target_argmax.device
    N = offsets[-1]
    flat = torch.cat([target_argmax, tokens.to(dev), parents.to(dev)]).tolist()
    top, toks, parents_ = flat[:N], flat[N: 2 * N], flat[2 * N:]
    out = []
    for at, end in zip(offsets[:-1], offsets[1:]):
        n = end - at
        depth, alive, best = [0] * n, [True] + [False] * (n - 1), 0
        for i in range(1, n):
            p = parents_[at + i]
            depth[i] = depth[p] + 1
            if alive[p] and toks[at + i] == top[at + p]:
                alive[i] = True
                if depth[i] > depth[best]:
                    best = i
        path, node = [], best
        while node >= 0:
            path.append(node)
            node = parents_[at + node]
        path.reverse()
        bonus = top[at + best]
        out.append(Accepted(path=tuple(path), bonus=bonus, tokens=(*(toks[at + i] for i in path[1:]), bonus),
                            depth=max(depth)))
    return out


def greedy_accept(tree: Tree, tokens: torch.Tensor, target_argmax: torch.Tensor) -> Accepted:
    """``greedy_accept_rows`` for one tree: tokens, target_argmax (n,) long."""
    return greedy_accept_rows(tokens, tree.parents, target_argmax, (0, tree.size))[0]


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p where p == q leaves nothing (rejection had probability 0)."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def rejection_accept_chain(
    p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, *, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative sampling over a chain of k drafts.

    p: (k + 1, V) target probs at the root and after each draft; q: (k, V) draft probs each draft
    was sampled from; draft_tokens: (k,). Accept draft j with probability min(1, p_j(x)/q_j(x));
    at the first rejection resample from norm(max(0, p_j - q_j)); if all pass, sample from p_k.
    Returns (num_accepted, next_token).
    """
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, draft_tokens] / q[rows, draft_tokens]
    u = torch.rand(k, generator=generator, device=p.device)
    rejected = (u >= ratio).nonzero()
    n = int(rejected[0]) if len(rejected) else k
    dist = _residual(p[n], q[n]) if n < k else p[k]
    return n, int(torch.multinomial(dist, 1, generator=generator))


def rejection_accept_tree(
    tree: Tree,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    q_index: torch.Tensor,
    *,
    generator: torch.Generator | None,
) -> Accepted:
    """Lossless multi-candidate speculative sampling down a tree (recursive rejection sampling).

    tokens: (n,); p: (n, V) target probs after each node; q: (R, V) draft distributions;
    q_index: (n,) the q row node i's token was drawn from (the root's entry is unused). Siblings
    drawn from one row were drawn without replacement, in rank order; a row may also be a point
    mass (a token copied from the context: its "draw" is certain).

    At a node, its children are tried in rank order: child x drawn from row q_r is accepted with
    probability min(1, p(x)/q_r(x)); on rejection p <- norm(max(0, p - q_r)) and x is removed
    from q_r (it was drawn without replacement, and the new p gives it zero mass anyway). Each try
    is a standard speculative-sampling step against the current residual, so the token that
    leaves the node is distributed exactly as the target's p, whichever rows the siblings came
    from. If no child is accepted the bonus token is drawn from the final residual; at a leaf, from p.
    """
    toks, rows = torch.stack([tokens.to(q_index.device), q_index]).tolist()
    u = torch.rand(tree.size - 1, generator=generator, device=p.device).tolist()   # node i's try: u[i - 1]
    path, node = [0], 0
    p_cur = p[0]
    while tree.children[node]:
        left: dict[int, torch.Tensor] = {}   # row -> its q with the siblings tried so far removed
        nxt = None
        for child in tree.children[node]:
            r, x = rows[child], toks[child]
            q_cur = left[r] if r in left else q[r]
            qx, px = torch.stack([q_cur[x].float(), p_cur[x].float()]).tolist()   # (one read a child tried)
            if qx <= 0:  # a padded duplicate, or mass already spent
                continue
            if u[child - 1] < px / qx:
                nxt = child
                break
            p_cur = _residual(p_cur, q_cur)
            q_cur = q_cur.clone()
            q_cur[x] = 0
            left[r] = q_cur / q_cur.sum().clamp(min=1e-30)   # (all zero stays all zero)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
        p_cur = p[node]
    bonus = int(torch.multinomial(p_cur, 1, generator=generator))
    return Accepted(path=tuple(path), bonus=bonus, tokens=(*(toks[i] for i in path[1:]), bonus))


def point_accept_tree(tree: Tree, tokens: torch.Tensor, p: torch.Tensor, *,
                      generator: torch.Generator | None) -> Accepted:
    """Lossless speculative sampling down a tree whose tokens were chosen without a draw (the draft's
    top candidates, a copied context): each node's q is a point mass on its own token.

    tokens: (n,); p: (n, V) target probs after each node. At a node, its children are tried in rank
    order: child x is accepted with probability r(x), r the node's residual, which starts at p and loses
    each rejected child's token (norm(max(0, r - onehot(x)))): so with p(x_1) .. p(x_j) of the children
    rejected so far, r(x) = p(x) / (1 - their sum). Each try is ``rejection_accept_tree``'s with a point
    mass, so the token that leaves the node is distributed exactly as p. Where every child is rejected,
    the bonus is drawn from the residual; past the last accepted node's children, from its p.

    Reads the host once for every node's chance and uniform, and once for the bonus."""
    n = tree.size
    if n == 1:
        bonus = int(torch.multinomial(p[0], 1, generator=generator))
        return Accepted(path=(0,), bonus=bonus, tokens=(bonus,))
    tokens = tokens.to(p.device)
    chance = p[tree.parents[1:].to(p.device), tokens[1:]]                  # (n - 1,) p of each child at its parent
    u = torch.rand(n - 1, generator=generator, device=p.device)
    chance, u, drafted = torch.stack([chance.float(), u, tokens[1:].float()]).tolist()   # (one read; ids < 2^24)
    toks = [0] + [int(x) for x in drafted]   # node i's token (the root's unused)
    path, node = [0], 0
    while True:   # a node without children accepts none: the walk ends there
        rejected, left, nxt = [], 1.0, None
        for child in tree.children[node]:
            x = toks[child]
            if x in rejected:   # a duplicate sibling: its token has no mass left
                continue
            if u[child - 1] * left < chance[child - 1]:
                nxt = child
                break
            rejected.append(x)
            left -= chance[child - 1]
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    dist = p[node]
    if rejected and left > 1e-6:   # (below: the rejected tokens held all the mass, so rejection had chance 0)
        dist = dist.clone()
        dist[rejected] = 0
    bonus = int(torch.multinomial(dist, 1, generator=generator))
    return Accepted(path=tuple(path), bonus=bonus, tokens=(*(toks[i] for i in path[1:]), bonus))
