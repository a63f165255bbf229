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
grafted the same way. Where neither has one, the last token alone is looked up in the context: a
weak cue (its copy is right about a quarter of the time), but one that most steps have.

How likely a copied chain is to be accepted depends on the match that found it: measured on the
target's own answers, the first token copied after a match of four tokens or more is right 88% of
the time, after two 48%, after one 23% (``settings.COPY_ACCEPT_BY_MATCH``). Each copied node's
path probability (``Draft.path_p``) says so, and width fitting (``runtime/width.py``) verifies as much of
each chain as the step's pass is worth on the machine: the long tail of a strong match, the first
token or two of a weak one, or none of it. Where a greedy chain runs through nodes the heads drafted
too, each such node takes the larger of the two chances (``grafted_path_p``): the copy's evidence is
not thrown away because a head was less sure of the same token.

Sampling too: a copied token is a draft whose q is a point mass on it (its "draw" was certain
given the context). Rejection sampling handles that exactly: accept it with probability p(x),
else continue from p with x removed. Grafted onto a draft with q rows (tokens drawn from a draft
distribution), each copied node gets a one-hot q row of its own, so the drawn siblings keep theirs
(``accept.rejection_accept_tree``); a draft without (the lookup alone) stays without, every node a
point mass (``accept.point_accept_tree``).

``context_match``, ``graft`` and ``copy_prior`` are pure functions; ``with_lookup`` applies them to a
step's drafts, for every drafter that copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.tree import Path, Tree, build_tree
from ..core.types import DecodeState, Draft, Drafter, Drafts, HostDraft, read_host
from ..corpus import Corpus
from ..settings import (
    COPY_ACCEPT_BY_MATCH,
    COPY_ACCEPT_FIRST,
    COPY_ACCEPT_NEXT,
    COPY_ACCEPT_SAMPLED_BY_MATCH,
    COPY_ACCEPT_SAMPLED_FIRST,
    COPY_ACCEPT_SAMPLED_NEXT,
    DEFAULT_LOOKUP,
)
from .base import check_lookup, prior_chance

MAX_NGRAM = 4    # a match this long or longer is the strongest cue (COPY_ACCEPT_BY_MATCH's last entry)
MIN_NGRAM = 2    # the shortest match tried before the corpus
WEAK_NGRAM = 1   # a single repeated token: tried after the corpus, with its low prior


def context_match(ids: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
                  ) -> tuple[list[int], int]:
    """(up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    ``ids`` that occurred before, that suffix's length n), counting at most ``max_ngram`` tokens of
    it: the match is the strongest (then latest) end of an earlier copy of the last token, and
    ``([], 0)`` if it is shorter than ``min_ngram`` or there is none. One pass over ``ids``."""
    if k <= 0 or min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need k >= 1 and 1 <= min_ngram <= max_ngram (got k={k}, {min_ngram}..{max_ngram})")
    ids = list(ids)
    end = len(ids)
    if end < 2:
        return [], 0
    last = ids[-1]
    best_at, best_n = -1, 0
    for at in range(end - 2, -1, -1):        # latest first; the last token itself (at = end - 1) excluded
        if ids[at] != last:
            continue
        n = 1
        while n < max_ngram and at >= n and ids[at - n] == ids[end - 1 - n]:
            n += 1
        if n > best_n:
            best_at, best_n = at, n
            if n == max_ngram:
                break
    if best_n < min_ngram:
        return [], 0
    return ids[best_at + 1: best_at + 1 + k], best_n


def copy_prior(match: int | None, *, sampled: bool) -> tuple[float, float]:
    """(the chance the first copied token is accepted, the chance of each next one given the one
    before) for a chain found by a context match of ``match`` tokens, or by the corpus (None)."""
    if match is None:
        return (COPY_ACCEPT_SAMPLED_FIRST, COPY_ACCEPT_SAMPLED_NEXT) if sampled else (COPY_ACCEPT_FIRST, COPY_ACCEPT_NEXT)
    table = COPY_ACCEPT_SAMPLED_BY_MATCH if sampled else COPY_ACCEPT_BY_MATCH
    return table[min(max(match, 1), len(table)) - 1]


def copied_chain(state: DecodeState, k: int, corpus: Corpus | None = None) -> tuple[list[int], tuple[float, float]]:
    """The chain a step copies and its (first, next) chances (``copy_prior``): the context's match of
    ``MIN_NGRAM`` tokens or more, else the ``corpus``'s, else the context's last token alone."""
    sampled = state.params.do_sample
    copied, n = context_match(state.ids, k, min_ngram=WEAK_NGRAM)
    if n < MIN_NGRAM and corpus is not None:
        from_corpus = corpus.continuation(state.ids, k)
        if from_corpus:
            return from_corpus, copy_prior(None, sampled=sampled)
    return copied, copy_prior(n, sampled=sampled)


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


def grafted_path_p(draft: Draft, tree: Tree, tokens: Sequence[int], chain: Sequence[int], prior: tuple[float, float],
                   *, agree: bool = False) -> list[float]:
    """(n,) path probabilities of ``tree`` (``draft``'s tree with the copied ``chain`` grafted on;
    ``tokens``: its node tokens): the draft's own for its nodes (the copied-token prior where it has
    none), and for each copied node its parent's times ``prior``'s first chance (under the root) or
    its next one (``copy_prior``).

    ``agree`` (greedy only): a drafted node that the chain walks through is proposed by both sources,
    so its chance is the larger of the draft's and the copy's (its parent's times the prior's); the
    copied nodes under it build on that. Without it, a strong match (88% first-token acceptance)
    that runs through a drafted node of chance 0.2 would inherit the 0.2 and be cut by width
    fitting, and the combined drafter would verify less of it than the lookup alone. When sampling
    it stays off: a kept node's score must not depend on the token drawn at it (``runtime/width.py``).
    Either way a node's chance never exceeds its parent's."""
    n_old, h = draft.tree.size, draft.host
    old = h.path_p if h.path_p is not None else [prior_chance(d) for d in h.depths]
    first, nxt = prior
    parents = tree.lists[0]
    out = list(old) + [0.0] * (tree.size - n_old)
    on_chain = chain_nodes(parents, tokens, chain) if agree else []
    for i in sorted(set(range(n_old, tree.size)) | set(on_chain)):
        copy = out[parents[i]] * (first if parents[i] == 0 else nxt)
        out[i] = max(out[i], copy) if i < n_old else copy
    return out


def chain_nodes(parents: Sequence[int], tokens: Sequence[int], chain: Sequence[int]) -> list[int]:
    """The nodes a copied ``chain`` walks through from the root (node 0), in order: at each step the
    child of the last node that holds the chain's next token. Parents precede children."""
    children: dict[tuple[int, int], int] = {}
    for i in range(1, len(parents)):
        children.setdefault((parents[i], int(tokens[i])), i)
    at, out = 0, []
    for t in chain:
        at = children.get((at, int(t)), -1)
        if at < 0:
            break
        out.append(at)
    return out


def with_lookup(drafts: Sequence[Draft], states: list[DecodeState], k: int, *, vocab_size: int,
                corpus: Corpus | None = None) -> Drafts:
    """A step's drafts, each with up to k copied tokens grafted on (``copied_chain``: from its row's
    context, or where that has no match of two tokens or more, from a ``corpus``, the target's own
    earlier answers, ``corpus.py``); a draft stays as it is when k is 0 or nothing matched. The drafts
    that take copies are read to the host together, in one transfer (``read_host``). Sampling, onto a
    draft with q rows: every new node gets a one-hot q row appended to ``draft.q`` (point mass on its token)."""
    chains = [copied_chain(s, k, corpus) for s in states] if k else []
    if not any(copied for copied, _ in chains):
        return Drafts.of(drafts)
    read_host([d for d, (copied, _) in zip(drafts, chains, strict=True) if copied])
    return Drafts([_grafted(d, s, copied, prior, vocab_size) if copied else d
                   for d, s, (copied, prior) in zip(drafts, states, chains)])


def _grafted(draft: Draft, state: DecodeState, copied: list[int], prior: tuple[float, float], vocab_size: int) -> Draft:
    """``draft`` with the ``copied`` chain grafted on, its copied nodes' chances from ``prior``."""
    tokens = draft.tokens
    known = draft.host.tokens   # (its tree's lists with it: ``Draft.host``)
    paths, merged = graft(draft.tree.paths, known, copied)
    tree = build_tree(paths, str(tokens.device))
    drawn = state.params.do_sample and draft.q is not None   # (q None: every node chosen without a draw)
    chances = grafted_path_p(draft, tree, merged, copied, prior, agree=not drawn)
    host = HostDraft(merged, *tree.lists, path_p=chances)   # what the runtime reads of it: known already
    merged, path_p = torch.tensor(merged, device=tokens.device), torch.tensor(chances, device=tokens.device)
    if not drawn:
        out = Draft(tree=tree, tokens=merged, resume=draft.resume, path_p=path_p)
        out.__dict__["host"] = host
        return out
    n_old, n_new = draft.tree.size, tree.size - draft.tree.size
    q_old = draft.q if draft.q is not None else torch.zeros(0, vocab_size, device=tokens.device)
    point = torch.zeros(n_new, vocab_size, dtype=q_old.dtype, device=q_old.device)
    point[torch.arange(n_new), merged[n_old:].to(q_old.device)] = 1.0
    rows = torch.cat([draft.q_rows().to(tokens.device),
                      q_old.shape[0] + torch.arange(n_new, device=tokens.device)])
    out = Draft(tree=tree, tokens=merged, q=torch.cat([q_old, point]), q_index=rows, resume=draft.resume, path_p=path_p)
    out.__dict__["host"] = host
    return out


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

    def draft(self, states: list[DecodeState]) -> Drafts:
        """Each row's root, with its copied chain grafted on. The roots are the rows' pending tokens, which
        the host knows: the graft reads nothing back from the device."""
        ids = [s.ids[-1] for s in states]
        roots = torch.tensor(ids, device=self.device)
        drafts = []
        for b, token in enumerate(ids):
            d = Draft(tree=self.tree, tokens=roots[b: b + 1])
            d.__dict__["host"] = HostDraft([token], [-1], [0], [0], path_p=None)
            drafts.append(d)
        return with_lookup(Drafts(drafts, tokens=roots), states, self.lookup, vocab_size=self.vocab_size,
                           corpus=self.corpus)
