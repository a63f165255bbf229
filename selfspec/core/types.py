"""The step types every part of the loop speaks, and the contract every drafter keeps.

Per step the loop asks the drafter for a ``Draft`` per row (a tree of candidate tokens, root = the
pending token), verifies every row's tree in one target pass (a ``TargetOut`` per row), accepts a path
per row (``accept.Accepted``) and commits it; the drafter then updates its state (``Drafter.commit_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .accept import Accepted
from .backbone import Backbone
from .cache import KVCache, RowView
from .sampling import SamplingParams
from .tree import Tree, build_tree


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
                                         # (its path probability; root 1); None: unknown (runtime/width.py)

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
        """Called before a decode with width fitting's prices (``runtime.width.VerifyCost``; None: no fitting) and
        the rows its passes run (a static step's, else None: the live rows). A drafter that drafts in
        stages may stop where another stage would not pay on this machine."""

    def warm_up(self, step, *, batch: int = 1, sampled: bool = False) -> None:
        """Compile now whatever static passes of its own decoding batches of ``batch`` rows with ``step``
        will run, greedy or ``sampled`` (a benchmark's warm-up calls it, so that no compilation falls in a
        timed run)."""

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


def plain_draft(state: DecodeState, device: torch.device) -> Draft:
    """A step that drafts nothing: the pending token alone (plain decoding)."""
    return Draft(tree=build_tree((), str(device)), tokens=torch.tensor([state.ids[-1]], device=device))


class WidthFit(Protocol):
    """The seam through which a runtime cuts each step's trees to what its pass is worth on this machine
    (``runtime.width.VerifyCost``). A cut keeps the root and never widens a tree, so output stays exact.
    A drafter that drafts in stages may ask it whether one more stage pays (``level_pays``)."""

    def fit(self, drafts: list[Draft], widest: int, rows: int | None = None) -> list[Draft]: ...

    def observe(self, rows: int, width: int) -> None: ...   # the step fitted last is done (the runtime times it)

    def level_pays(self, chances: list[torch.Tensor], children: list[torch.Tensor], *, rows: int, widest: int,
                   running: int) -> bool: ...   # one more stage, of ``running`` rows (the runtime times the stages)


class Pace(Protocol):
    """The seam through which a runtime turns drafting off where it does not pay (``backoff.Backoff``). A step
    it does not draft is a plain one (the pending token alone), which changes what is drafted, never what
    is committed."""

    def start(self) -> None: ...

    def draft_now(self) -> bool: ...   # a step begins (the runtime times it)

    def observe(self, rows: int, tokens: int, drafted: bool) -> None: ...   # ... and has committed ``tokens``


class VerifyStep(Protocol):
    """The seam through which a runtime runs verification at static shapes (``runtime.step.StaticStep``); a
    drafter with passes of its own may run them the same way (``function``, at ``bucket`` sizes)."""

    storage: object      # hands the step's cache buffers back after a decode (``release``)
    backbone: Backbone
    capacity: int        # positions per row of its static cache
    compiled: bool

    def function(self, fn): ...

    def bucket(self, n: int) -> int: ...

    def new_cache(self, batch: int, positions: int) -> KVCache: ...

    def verify(self, backbone: Backbone, cache: KVCache, pasts: list[int], drafts: list[Draft], *,
               rows: list[int], capture: tuple[int, ...] = ()) -> list[TargetOut]: ...
