"""Sampling is lossless: speculative sampling reproduces the target's distribution exactly.

A toy first-order Markov "target" P and a deliberately different "draft" Q over a small
vocabulary. Sequences of L tokens are produced by repeated speculative steps (chain or tree),
and their empirical distribution is compared with the exact one by a chi-square statistic.
A planted bug (resampling from p instead of the residual) must fail the same check.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import chi2_check

from selfspec.core.accept import point_accept_tree, rejection_accept_chain, rejection_accept_tree
from selfspec.core.sampling import SamplingParams, probs_from_logits
from selfspec.core.tree import build_tree, chain, prune

V, L, N = 5, 3, 12000


def _toy(seed: int, params: SamplingParams):
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(V, V, generator=g) * 1.5
    q_logits = torch.randn(V, V, generator=g) * 1.5  # unrelated to p: plenty of rejections
    return probs_from_logits(p_logits, params), probs_from_logits(q_logits, params)


def _exact(P: torch.Tensor, root: int) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        prob, prev = 1.0, root
        for t in seq:
            prob *= float(P[prev, t])
            prev = t
        out[seq] = prob
    return out


def _assert_matches(counts, exact, n):
    stat, threshold = chi2_check(counts, exact, n)
    assert stat < threshold, f"chi2={stat:.1f} >= {threshold:.1f}: not the target distribution"


def _chain_sequences(P, Q, root, k, gen, *, accept=rejection_accept_chain):
    counts = {}
    for _ in range(N):
        seq, prev = [], root
        while len(seq) < L:
            drafts, last = [], prev
            for _ in range(k):
                last = int(torch.multinomial(Q[last], 1, generator=gen))
                drafts.append(last)
            ctx = [prev] + drafts
            p = P[ctx]                 # (k + 1, V): target after root and after each draft
            q = Q[ctx[:-1]]            # (k, V): what each draft was drawn from
            n, nxt = accept(p, q, torch.tensor(drafts), generator=gen)
            seq.extend(drafts[:n] + [nxt])
            prev = seq[-1]
        key = tuple(seq[:L])
        counts[key] = counts.get(key, 0) + 1
    return counts


PARAMS = [
    SamplingParams(do_sample=True, temperature=1.0),
    SamplingParams(do_sample=True, temperature=0.6),
    SamplingParams(do_sample=True, temperature=1.4, top_p=0.8),
    SamplingParams(do_sample=True, temperature=1.0, top_k=3),
    SamplingParams(do_sample=True, temperature=1.0, min_p=0.3),
]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.6", "t1.4-p0.8", "t1-k3", "t1-minp0.3"])
def test_chain_rejection_sampling_is_lossless(params):
    P, Q = _toy(0, params)
    gen = torch.Generator().manual_seed(1)
    _assert_matches(_chain_sequences(P, Q, 0, 2, gen), _exact(P, 0), N)


def _buggy_chain(p, q, drafts, *, generator):
    """Planted bug: on rejection resample from p instead of norm(max(0, p - q))."""
    k = drafts.shape[0]
    for j in range(k):
        x = int(drafts[j])
        if float(torch.rand((), generator=generator)) >= float(p[j, x] / q[j, x]):
            return j, int(torch.multinomial(p[j], 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def test_statistical_check_catches_a_planted_bug():
    params = PARAMS[0]
    P, Q = _toy(0, params)
    gen = torch.Generator().manual_seed(1)
    counts = _chain_sequences(P, Q, 0, 2, gen, accept=_buggy_chain)
    stat, threshold = chi2_check(counts, _exact(P, 0), N)
    assert stat > threshold


TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))


def _row_conf(q_row: torch.Tensor, token: int) -> float:
    """What the drafters prune on when sampling: the row's largest probability, whatever was drawn."""
    return float(q_row.max())


def _count(step, root: int) -> dict:
    """Counts of the first L tokens of N sequences, each grown from ``root`` by speculative steps:
    ``step(prev)`` -> the tokens one step commits after token ``prev``."""
    counts = {}
    for _ in range(N):
        seq, prev = [], root
        while len(seq) < L:
            seq.extend(step(prev))
            prev = seq[-1]
        key = tuple(seq[:L])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _tree_sequences(P, Q, root, gen, *, threshold: float = 0.0, conf=_row_conf):
    """Each node's children are drawn without replacement from Q[node token], in rank order.

    threshold > 0: then the tree is cut with ``tree.prune`` on conf(parent's q row, node token),
    as the drafters do each step, and only the kept nodes are verified."""
    full = build_tree(TREE)

    def step(prev):
        tokens = [prev]
        draws = {}
        tree = full
        for i in range(1, tree.size):
            parent = int(tree.parents[i])
            if parent not in draws:
                width = len(tree.children[parent])
                draws[parent] = torch.multinomial(Q[tokens[parent]], width, replacement=False, generator=gen).tolist() \
                    if int((Q[tokens[parent]] > 0).sum()) >= width else None
            cand = draws[parent]
            tokens.append(cand[int(tree.ranks[i])] if cand else tokens[parent])
        if threshold > 0:
            node_conf = torch.tensor([1.0] + [conf(Q[tokens[int(full.parents[i])]], tokens[i])
                                              for i in range(1, full.size)])
            kept = prune(full, node_conf, threshold)
            tree = build_tree(kept)
            tokens = [tokens[0]] + [tokens[full.paths.index(p) + 1] for p in kept]
        tok = torch.tensor(tokens)
        acc = rejection_accept_tree(tree, tok, P[tok], Q[tok], tree.parents.clamp(min=0), generator=gen)
        return [tokens[i] for i in acc.path[1:]] + [acc.bonus]

    return _count(step, root)


@pytest.mark.parametrize("params", PARAMS[:3], ids=["t1", "t0.6", "t1.4-p0.8"])
def test_tree_rejection_sampling_is_lossless(params):
    P, Q = _toy(2, params)
    gen = torch.Generator().manual_seed(3)
    _assert_matches(_tree_sequences(P, Q, 1, gen), _exact(P, 1), N)


@pytest.mark.parametrize("params", PARAMS[:2], ids=["t1", "t0.6"])
def test_confidence_pruned_tree_sampling_is_lossless(params):
    """Cutting the tree where the draft rows are unsure keeps sampling exact, provided the cut reads q
    only (the row's maximum), never which token was drawn."""
    P, Q = _toy(2, params)
    gen = torch.Generator().manual_seed(5)
    _assert_matches(_tree_sequences(P, Q, 1, gen, threshold=0.3), _exact(P, 1), N)


def test_pruning_on_the_drawn_tokens_probability_is_caught():
    """Planted bug: cut each node on q(its own token). Proposals are then no longer plain draws
    from q, the acceptance rule's assumption, and the output distribution shifts."""
    P, Q = _toy(2, PARAMS[0])
    gen = torch.Generator().manual_seed(5)
    counts = _tree_sequences(P, Q, 1, gen, threshold=0.3, conf=lambda q_row, token: float(q_row[token]))
    stat, threshold = chi2_check(counts, _exact(P, 1), N)
    assert stat > threshold


def test_tree_with_single_children_equals_chain_rule():
    """A chain is a tree with one child per node: both rules must give the same draws from the same seed."""
    params = PARAMS[0]
    P, Q = _toy(4, params)
    tree = build_tree(chain(3))
    for seed in range(50):
        g = torch.Generator().manual_seed(100 + seed)
        drafts = [int(torch.multinomial(Q[0], 1, generator=g))]
        for _ in range(2):
            drafts.append(int(torch.multinomial(Q[drafts[-1]], 1, generator=g)))
        ctx = torch.tensor([0] + drafts)
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        n, nxt = rejection_accept_chain(P[ctx], Q[ctx[:-1]], torch.tensor(drafts), generator=g1)
        acc = rejection_accept_tree(tree, ctx, P[ctx], Q[ctx], tree.parents.clamp(min=0), generator=g2)
        # Same uniforms in the same order up to the first rejection -> same accepted length; when all
        # are accepted both then draw the bonus from p_k with the generator in the same state.
        assert acc.num_accepted == n
        if n == 3:
            assert acc.bonus == nxt


def _point_sequences(P, Q, root, gen, *, accept=None):
    """Each node's children are Q's top candidates after the node's token, chosen without a draw (the
    drafters' trees when sampling with point masses); a lookup-like duplicate sibling is grafted under the
    root. ``accept``: the rule under test (default ``point_accept_tree``)."""
    accept = accept or point_accept_tree
    tree = build_tree(TREE + ((3,),))

    def step(prev):
        tokens = [prev]
        for i in range(1, tree.size):
            rank, top = int(tree.ranks[i]), Q[tokens[int(tree.parents[i])]].topk(3).indices.tolist()
            tokens.append(top[rank] if rank < 3 else top[0])   # rank 3: a duplicate of rank 0
        tok = torch.tensor(tokens)
        acc = accept(tree, tok, P[tok], generator=gen)
        return [tokens[i] for i in acc.path[1:]] + [acc.bonus]

    return _count(step, root)


@pytest.mark.parametrize("params", PARAMS[:3], ids=["t1", "t0.6", "t1.4-p0.8"])
def test_point_mass_tree_sampling_is_lossless(params):
    P, Q = _toy(2, params)
    gen = torch.Generator().manual_seed(7)
    _assert_matches(_point_sequences(P, Q, 1, gen), _exact(P, 1), N)


def _point_bonus_from_p(tree, tokens, p, *, generator):
    """Planted bug: where every child is rejected, draw the bonus from p, rejected tokens included."""
    acc = point_accept_tree(tree, tokens, p, generator=generator)
    if acc.path == (0,) and tree.size > 1:
        bonus = int(torch.multinomial(p[0], 1, generator=generator))
        return type(acc)(path=(0,), bonus=bonus, tokens=(bonus,))
    return acc


def test_point_mass_check_catches_a_bonus_drawn_from_p():
    P, Q = _toy(2, PARAMS[0])
    gen = torch.Generator().manual_seed(7)
    stat, threshold = chi2_check(_point_sequences(P, Q, 1, gen, accept=_point_bonus_from_p), _exact(P, 1), N)
    assert stat > threshold


def test_point_masses_agree_with_one_hot_rows():
    """``point_accept_tree`` is ``rejection_accept_tree`` with a one-hot q row per node: the same accepted
    paths' frequencies on one tree and one p, over many draws."""
    P, Q = _toy(3, PARAMS[0])
    tree = build_tree(TREE)
    tokens = [0]
    for i in range(1, tree.size):
        tokens.append(Q[tokens[int(tree.parents[i])]].topk(3).indices.tolist()[int(tree.ranks[i])])
    tok = torch.tensor(tokens)
    one_hot = torch.nn.functional.one_hot(tok, V).float()
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    a, b = {}, {}
    for _ in range(4000):
        x = point_accept_tree(tree, tok, P[tok], generator=g1).tokens
        y = rejection_accept_tree(tree, tok, P[tok], one_hot, torch.arange(tree.size), generator=g2).tokens
        a[x], b[y] = a.get(x, 0) + 1, b.get(y, 0) + 1
    for key in set(a) | set(b):   # within 5 standard deviations of each other
        pa, pb = a.get(key, 0) / 4000, b.get(key, 0) / 4000
        assert abs(pa - pb) <= 5 * ((pa * (1 - pa) + pb * (1 - pb)) / 4000) ** 0.5 + 2e-3, key
