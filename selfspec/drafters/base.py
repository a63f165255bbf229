"""What every drafter shares: the decode state it reads, the Draft it returns, the hooks it gets."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from ..backbone import Backbone
from ..cache import RowView
from ..sampling import SamplingParams, pick_candidates, probs_from_logits
from ..settings import COPY_ACCEPT_FIRST, COPY_ACCEPT_NEXT
from ..tree import Tree, build_tree, prune
from ..verify import Accepted


@dataclass
class DecodeState:
    """Invariant: ``cache`` holds every token of ``ids`` except the last, the *pending* token
    (already chosen by the target, not yet run through it). So ``past_len == len(ids) - 1``."""

    ids: list[int]
    cache: RowView         # this row of the target's KV cache (cache.KVCache.row)
    params: SamplingParams
    generator: torch.Generator | None
    min_length: int = 0    # the row may not end (emit EOS) before its text is this long (min_new_tokens, min_length)

    @property
    def past_len(self) -> int:
        return len(self.ids) - 1


@dataclass(frozen=True)
class Resume:
    """Hidden states after ``layer`` decoder layers for the first m tree nodes, whose KV in
    layers < ``layer`` the drafter has already written to the cache (early exit)."""

    layer: int
    hidden: torch.Tensor  # (1, m, H)


@dataclass(frozen=True)
class Draft:
    tree: Tree
    tokens: torch.Tensor              # (n,) long; tokens[0] = pending root
    q: torch.Tensor | None = None     # (R, V) draft probs (sampling only)
    q_index: torch.Tensor | None = None  # (n,) the q row node i was drawn from; None: row depth(i) - 1
    resume: Resume | None = None
    path_p: torch.Tensor | None = None   # (n,) each node's chance of acceptance as the draft sees it
                                         # (its path probability; root 1); None: unknown (budget.py)

    def q_rows(self) -> torch.Tensor:
        """(n,) the q row each node's token was drawn from (the root's entry is unused)."""
        return self.q_index if self.q_index is not None else (self.tree.depths - 1).clamp(min=0)


@dataclass
class TargetOut:
    logits: torch.Tensor   # (n, V) target logits after each node
    hidden: torch.Tensor   # (n, H) final post-norm hidden states
    captured: tuple[torch.Tensor, ...] = ()  # (1, n, H) after each layer in ``Drafter.capture_layers``


class Drafter:
    """Subclasses implement ``draft``; the hooks default to doing nothing."""

    name: str = "?"
    heads = None  # a heads.Heads for drafters with trainable heads
    capture_layers: tuple[int, ...] = ()  # ask the target passes for the hidden states after these many layers

    @property
    def max_nodes(self) -> int:
        """The most tree nodes (root included) one draft can have: a static step compiles that far."""
        tree = getattr(self, "tree", None)
        return (1 if tree is None else tree.size) + getattr(self, "lookup", 0)

    def use_step(self, step) -> None:
        """Called before a decode with its static verify step (``step.StaticStep``, ``compile=True``) or
        None (eager). A drafter that runs passes of its own may run them at static shapes to match."""

    def use_cost(self, cost, rows: int | None = None) -> None:
        """Called before a decode with width fitting's prices (``budget.VerifyCost``; None: no fitting) and
        the rows its passes run (a static step's, else None: the live rows). A drafter that drafts in
        stages may stop where another stage would not pay on this machine."""

    def warm_up(self, step, *, batch: int = 1) -> None:
        """Compile now whatever static passes of its own decoding batches of ``batch`` rows with ``step``
        will run (a benchmark's warm-up calls it, so that no compilation falls in a timed run)."""

    def begin(self, state: DecodeState, prefill: TargetOut) -> None:
        """Called once after prefill; ``prefill.hidden[-1]`` produced the pending token."""

    @classmethod
    def begin_rows(cls, drafters: list["Drafter"], states: list[DecodeState], prefills: list[TargetOut]) -> None:
        """``begin`` for a batch: ``drafters[i]`` (a copy per row) begins row i. Row by row here; a drafter
        whose rows share batched state (the eagle head's cache) overrides it."""
        for d, s, out in zip(drafters, states, prefills):
            d.begin(s, out)

    def draft(self, state: DecodeState) -> Draft:
        raise NotImplementedError

    @classmethod
    def draft_rows(cls, drafters: list["Drafter"], states: list[DecodeState]) -> list[Draft]:
        """One step's drafts for a batch: ``drafters[i]`` (a copy per row, holding that row's state)
        drafts ``states[i]``. Row by row here; a drafter whose model calls batch well overrides it
        with one call for all rows (Medusa), drawing each row's candidates in row order as the loop
        would, so sampling consumes the generator alike."""
        return [d.draft(s) for d, s in zip(drafters, states)]

    def commit(self, state: DecodeState, accepted: Accepted, out: TargetOut) -> None:
        """Called after the target committed ``accepted``; ``state`` is already updated."""

    @classmethod
    def commit_rows(cls, drafters: list["Drafter"], states: list[DecodeState], accepted: list[Accepted],
                    outs: list[TargetOut]) -> None:
        """``commit`` for a batch, row by row here; a drafter whose rows share batched state (the eagle
        head's cache) overrides it with one call for all rows."""
        for d, s, a, out in zip(drafters, states, accepted, outs):
            d.commit(s, a, out)


@dataclass(frozen=True)
class Candidates:
    tokens: torch.Tensor          # (R, width) token ids in rank order, one row per depth
    q: torch.Tensor | None        # (R, V) full-vocabulary draft probs (sampling), None when greedy
    conf: torch.Tensor            # (R, width) the draft's confidence in each candidate (see below)


def row_candidates(
    logits: torch.Tensor, width: int, *, vocab: torch.Tensor | None, vocab_size: int, state: DecodeState
) -> Candidates:
    """(R, V_draft) draft logits -> the top ``width`` (greedy) or ``width`` draws without
    replacement (sampling) per row, mapped from the draft vocabulary back to token ids.

    conf, which ``tree.prune`` uses to drop unlikely candidates: greedy, each candidate's draft
    probability; sampling, the row's largest probability for every candidate of the row. When
    sampling, whether a row is proposed at all must not depend on which tokens were drawn from
    it (the acceptance rule assumes the candidates are plain draws from q), so the whole row
    stands or falls together, decided by q alone.
    """
    if state.params.do_sample:
        q_small = probs_from_logits(logits, state.params)
        cand = pick_candidates(q_small, width, params=state.params, generator=state.generator)
        q = full_vocab(q_small, vocab, vocab_size)
        conf = q_small.max(-1, keepdim=True).values.expand(-1, width)
    else:
        cand = pick_candidates(logits, width, params=state.params, generator=None)
        q = None
        conf = logits.float().softmax(-1).gather(1, cand)
    return Candidates(tokens=cand if vocab is None else vocab[cand], q=q, conf=conf)


def full_vocab(q: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """(R, V_draft) draft probabilities -> (R, V) over the whole vocabulary (zero outside the draft's)."""
    return q if vocab is None else q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)


def layout(tree: Tree, root: int, cand: torch.Tensor) -> torch.Tensor:
    """Node i at depth d and rank r gets candidate r of row d - 1 -> (n,) tokens, root first.

    Medusa and early exit draft one distribution per depth (Medusa's head d, or the chain node at
    depth d - 1), so row d - 1 is the q a depth-d node was drawn from (``Draft.q_rows``' default).
    """
    body = cand[tree.depths[1:] - 1, tree.ranks[1:]]
    return torch.cat([torch.tensor([root], device=body.device, dtype=body.dtype), body])


def prior_path_p(tree: Tree) -> torch.Tensor:
    """(n,) each node's chance when no draft distribution gives one: the copied-token prior by depth
    (settings.COPY_ACCEPT_*; root 1)."""
    d = tree.depths.to(torch.float32)
    return torch.where(d > 0, COPY_ACCEPT_FIRST * COPY_ACCEPT_NEXT ** (d - 1).clamp(min=0), torch.ones_like(d))


def layout_path_p(tree: Tree, conf: torch.Tensor) -> torch.Tensor:
    """(n,) each node's path probability, from ``conf`` (R, width) laid out as ``layout`` lays out
    candidates (node at depth d and rank r: conf[d - 1, r]); the root's is 1."""
    c = torch.ones(tree.size, dtype=torch.float32, device=conf.device)
    c[1:] = conf[tree.depths[1:] - 1, tree.ranks[1:]].float()
    return (tree.ancestors.to(conf.device).float() @ c.clamp(min=1e-30).log()).exp()


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


def pruned(tree: Tree, conf: torch.Tensor, threshold: float, gate: float = 0.0) -> Tree:
    """``tree`` cut where the draft is unsure (``tree.prune``: node threshold, then whole-tree gate).

    conf: (R, width) per-candidate confidences, one row per depth (``Candidates.conf``)."""
    if threshold <= 0 and gate <= 0:
        return tree
    return build_tree(prune(tree, layout(tree, 1.0, conf), threshold, gate), str(tree.parents.device))


def tree_width(tree: Tree) -> int:
    return max((tree.width_at(d) for d in range(1, tree.depth + 1)), default=1)


def draft_head(backbone: Backbone, vocab: torch.Tensor | None):
    """(.., H) -> (.., V_draft): the LM-head rows a draft scores against, all of them or a frequent-token subset."""
    weight, bias = backbone.lm_head.weight, backbone.lm_head.bias
    if vocab is not None:
        weight, bias = weight.index_select(0, vocab), None if bias is None else bias.index_select(0, vocab)
    return functools.partial(F.linear, weight=weight, bias=bias)
