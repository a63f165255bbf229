"""Context lookup: candidates copied from the text so far, grafted onto a draft tree.

Generated text often repeats its context: code reuses the names in a signature and docstring,
edits and summaries copy phrases of their input. When the last few tokens occurred earlier,
the tokens that followed them then are a free guess at what follows now (prompt lookup
decoding, Saxena 2023). ``MedusaDrafter(lookup=k)`` grafts such a chain of up to k tokens onto
its tree each greedy step: where the chain agrees with the heads' candidates it follows their
nodes, and from its first disagreement on it adds nodes of its own. It costs no model call;
the verifier pays for the extra nodes only on steps that found a match. Acceptance is
unchanged, so the output is still exactly plain greedy decoding's.

``LookupDrafter`` (drafter ``"lookup"``) drafts such chains alone, with no heads and no
training: selfspec's own prompt lookup decoding.

Where the context has no match, a ``Corpus`` (``corpus.py``: the target's own earlier answers)
proposes the chain instead, by majority vote over where the last tokens occurred there; it is
grafted the same way.

Sampling too: a copied token is a draft whose q is a point mass on it (its "draw" was certain
given the context). Rejection sampling handles that exactly: accept it with probability p(x),
else continue from p with x removed (``verify.rejection_accept_tree``). Each copied node gets a
one-hot q row of its own, so siblings drawn from a draft distribution keep theirs.

``context_continuation`` and ``graft`` are pure functions; ``with_lookup`` applies them to a
step's draft, for both drafters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..corpus import Corpus
from ..settings import (COPY_ACCEPT_FIRST, COPY_ACCEPT_NEXT, COPY_ACCEPT_SAMPLED_FIRST, COPY_ACCEPT_SAMPLED_NEXT,
                        DEFAULT_LOOKUP)
from ..tree import Path, Tree, build_tree
from .base import DecodeState, Draft, Drafter, check_lookup, prior_path_p

MAX_NGRAM = 3   # longest suffix looked up first, down to
MIN_NGRAM = 2   # a single repeated token is too weak a cue: most of its continuations are wrong


def context_continuation(ids: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    ``ids`` (``max_ngram`` tokens, down to ``min_ngram``) that occurred before; [] if none did."""
    if k <= 0 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram (got k={k}, {min_ngram}..{max_ngram})")
    ids = list(ids)
    end = len(ids)
    for n in range(max_ngram, min_ngram - 1, -1):
        if end <= n:
            continue
        suffix, first = ids[end - n:], ids[end - n]
        for j in range(end - n - 1, -1, -1):     # latest first; the suffix itself (j = end - n) excluded
            if ids[j] == first and ids[j:j + n] == suffix:
                return ids[j + n: j + n + k]
    return []


def graft(paths: tuple[Path, ...], tokens: Sequence[int], chain: Sequence[int]) -> tuple[tuple[Path, ...], list[int]]:
    """Merge ``chain`` (tokens to follow the root) into a tree given as paths and node tokens.

    tokens[i] is node i's token (node 0 the root, node i >= 1 the one at paths[i - 1]). The chain
    walks down from the root through nodes holding its tokens; at its first token no child holds,
    it branches off with a new child (rank one past its siblings') and continues as a chain of new
    nodes. New nodes come after the tree's own, so parents still precede children. Returns
    (paths, tokens) of the merged tree; the original nodes keep their ids.
    """
    paths, tokens = list(paths), list(tokens)
    if len(tokens) != len(paths) + 1:
        raise ValueError(f"{len(paths)} paths need {len(paths) + 1} node tokens (root first), got {len(tokens)}")
    children: dict[Path, dict[int, Path]] = {(): {}}   # path -> {token: child path}
    next_rank: dict[Path, int] = {(): 0}
    for p, t in zip(paths, tokens[1:]):
        children.setdefault(p[:-1], {}).setdefault(t, p)
        children.setdefault(p, {})
        next_rank[p[:-1]] = max(next_rank.get(p[:-1], 0), p[-1] + 1)
    at: Path = ()
    for t in chain:
        known = children.get(at, {}).get(t)
        if known is None:
            known = at + (next_rank.get(at, 0),)
            next_rank[at] = known[-1] + 1
            children.setdefault(at, {})[t] = known
            paths.append(known)
            tokens.append(int(t))
        at = known
    return tuple(paths), tokens


def grafted_path_p(draft: Draft, tree: Tree, *, sampled: bool = False) -> torch.Tensor:
    """(n,) path probabilities of ``tree`` (``draft``'s tree with copied nodes appended): the draft's own
    for its nodes (the copied-token prior where it has none), and for each copied node its parent's
    times COPY_ACCEPT_FIRST (under the root) or COPY_ACCEPT_NEXT (settings.py; their SAMPLED pair
    when ``sampled``). A copied node's chance never exceeds its parent's."""
    n_old = draft.tree.size
    old = draft.path_p.float() if draft.path_p is not None else prior_path_p(draft.tree).to(draft.tokens.device)
    first, nxt = (COPY_ACCEPT_SAMPLED_FIRST, COPY_ACCEPT_SAMPLED_NEXT) if sampled else (COPY_ACCEPT_FIRST, COPY_ACCEPT_NEXT)
    parents = tree.parents.tolist()
    out = old.tolist() + [0.0] * (tree.size - n_old)
    for i in range(n_old, tree.size):
        out[i] = out[parents[i]] * (first if parents[i] == 0 else nxt)
    return torch.tensor(out, device=old.device)


def with_lookup(draft: Draft, state: DecodeState, k: int, *, vocab_size: int, corpus: Corpus | None = None) -> Draft:
    """A step's draft with up to k context tokens grafted on (unchanged when k is 0 or nothing matched).

    Where the context has no match, a ``corpus`` (the target's own earlier answers, ``corpus.py``)
    proposes the chain instead. Sampling: every new node gets a one-hot q row appended to
    ``draft.q`` (point mass on its token)."""
    copied = context_continuation(state.ids, k) if k else []
    if not copied and k and corpus is not None:
        copied = corpus.continuation(state.ids, k)
    if not copied:
        return draft
    tokens = draft.tokens
    paths, merged = graft(draft.tree.paths, tokens.tolist(), copied)
    tree = build_tree(paths, str(tokens.device))
    merged = torch.tensor(merged, device=tokens.device)
    path_p = grafted_path_p(draft, tree, sampled=state.params.do_sample)
    if not state.params.do_sample:
        return Draft(tree=tree, tokens=merged, resume=draft.resume, path_p=path_p)
    n_old, n_new = draft.tree.size, tree.size - draft.tree.size
    q_old = draft.q if draft.q is not None else torch.zeros(0, vocab_size, device=tokens.device)
    point = torch.zeros(n_new, vocab_size, dtype=q_old.dtype, device=q_old.device)
    point[torch.arange(n_new), merged[n_old:].to(q_old.device)] = 1.0
    rows = torch.cat([draft.q_rows().to(tokens.device),
                      q_old.shape[0] + torch.arange(n_new, device=tokens.device)])
    return Draft(tree=tree, tokens=merged, q=torch.cat([q_old, point]), q_index=rows, resume=draft.resume, path_p=path_p)


class LookupDrafter(Drafter):
    """Proposes only the context's continuation (up to ``lookup`` tokens) as a chain, or, where the
    context has none, the ``corpus``'s."""

    name = "lookup"

    def __init__(self, device: torch.device, lookup: int = DEFAULT_LOOKUP, *, vocab_size: int,
                 corpus: Corpus | None = None):
        if check_lookup(lookup) < 1:
            raise ValueError("the lookup drafter needs lookup >= 1 (the most context tokens it copies per step)")
        self.lookup = lookup
        self.corpus = corpus
        self.vocab_size = vocab_size
        self.device = str(device)
        self.tree = build_tree((), self.device)

    def draft(self, state: DecodeState) -> Draft:
        root = Draft(tree=self.tree, tokens=torch.tensor([state.ids[-1]], device=self.device))
        return with_lookup(root, state, self.lookup, vocab_size=self.vocab_size, corpus=self.corpus)
