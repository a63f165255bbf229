"""The step types every part of the loop speaks, and the contract every drafter keeps.

Per step the loop asks the drafter for the live rows' ``Drafts`` (one flat batch of every row's tree of
candidate tokens, root = the pending token; ``drafts[i]`` is row i's ``Draft``), verifies every row's tree in
one target pass (``Verified``: a ``TargetOut`` per row), accepts a path per row (``accept.Accepted``) and
commits it; the drafter then updates its per-row state (``Drafter.commit``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .accept import Accepted
from .backbone import Backbone
from .cache import KVCache, RowView
from .sampling import SamplingParams
from .tree import Tree, build_tree, tree_tensors


@dataclass
class DecodeState:
    """Invariant: ``cache`` holds every token of ``ids`` except the last, the *pending* token
    (already chosen by the target, not yet run through it). So ``past_len == len(ids) - 1``."""

    ids: list[int]
    cache: RowView         # this row of the target's KV cache (cache.KVCache.row)
    params: SamplingParams
    generator: torch.Generator | None
    min_length: int = 0    # the row may not end (emit EOS) before its text is this long (min_new_tokens, min_length)
    row: int = 0           # the row's place in the batch: where a drafter keeps its state (``Drafter``)

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
    q: torch.Tensor | None = None     # (R, V) the draft distributions drawn from (sampling); None: no draws
    q_index: torch.Tensor | None = None  # (n,) the q row node i was drawn from; None: row depth(i) - 1
    resume: Resume | None = None
    path_p: torch.Tensor | None = None   # (n,) each node's chance of acceptance as the draft sees it
                                         # (its path probability; root 1); None: unknown (runtime/width.py)

    def q_rows(self) -> torch.Tensor:
        """(n,) the q row each node's token was drawn from (the root's entry is unused)."""
        return self.q_index if self.q_index is not None else (self.tree.depths - 1).clamp(min=0)

    @functools.cached_property
    def host(self) -> "HostDraft":
        """What the host reads of this draft (``read_host``: one transfer, kept)."""
        return read_host([self])[0]


@dataclass(frozen=True)
class HostDraft:
    """A draft's tokens, tree and path probabilities as Python lists: what a runtime deciding on the host
    (a width to verify, a graft) reads of it, in one transfer for every row of a step (``read_host``)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    ranks: list[int]
    path_p: list[float] | None   # None: the draft gives none


def read_host(drafts: list[Draft]) -> list[HostDraft]:
    """Every draft's ``Draft.host``, read from the device in ONE transfer for those not read yet (float32
    carries token ids exactly: below 2^24)."""
    todo = [d for d in drafts if "host" not in d.__dict__]
    if todo:
        parts = []
        for d in todo:
            t, known = d.tree, "lists" in d.tree.__dict__   # (a tree built from paths: its lists are known)
            parts += [d.tokens] + ([] if known else [t.parents, t.depths, t.ranks]) \
                + ([] if d.path_p is None else [d.path_p])
        dev = parts[0].device
        flat = torch.cat([x.to(device=dev, dtype=torch.float32).reshape(-1) for x in parts]).tolist()
        at = 0

        def take(n: int) -> list[float]:
            nonlocal at
            at += n
            return flat[at - n: at]

        for d in todo:
            n = d.tree.size
            tokens = [int(x) for x in take(n)]
            if "lists" not in d.tree.__dict__:
                d.tree.__dict__["lists"] = tuple([int(x) for x in take(n)] for _ in range(3))
            parents, depths, ranks = d.tree.lists
            d.__dict__["host"] = HostDraft(tokens, parents, depths, ranks,
                                           path_p=None if d.path_p is None else take(n))
    return [d.host for d in drafts]


class Drafts(Sequence[Draft]):
    """One step's drafts for the live rows as one flat batch: every row's nodes one after another, each row's
    root first, so row i holds nodes ``offsets[i]`` to ``offsets[i + 1] - 1`` of ``tokens`` (N,) and ``parents``
    (N,) (a node's parent's place within its row; a root's -1). The verify pass, the greedy acceptance and
    the statistics read a step from these in a fixed number of tensor ops whatever its rows; ``drafts[i]``
    is row i's own ``Draft`` (its tree, and what a sampling acceptance, a resumed pass, a width cut or a
    graft reads of one row). The offsets are known on the host: no read."""

    def __init__(self, rows: Sequence[Draft], *, tokens: torch.Tensor | None = None,
                 parents: torch.Tensor | None = None):
        """``rows``: each row's draft. A drafter that drafts every row at once passes its rows' tokens and
        parents flat as well (what ``rows`` hold, one after another), so that nothing is copied to lay them
        out again."""
        self.rows = tuple(rows)
        self.sizes = [d.tree.size for d in self.rows]
        self.offsets = tuple(itertools.accumulate(self.sizes, initial=0))
        for name, flat in (("tokens", tokens), ("parents", parents)):
            if flat is not None:
                if flat.shape != (self.offsets[-1],):
                    raise ValueError(f"flat {name} of shape {tuple(flat.shape)} for {self.offsets[-1]} nodes")
                self.__dict__[name] = flat

    @classmethod
    def of(cls, drafts: "Sequence[Draft]") -> "Drafts":
        """``drafts`` as a batch (itself when it is one)."""
        return drafts if isinstance(drafts, Drafts) else cls(drafts)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def _flat(self, part) -> torch.Tensor:
        parts = [part(d) for d in self.rows]
        dev = parts[0].device
        return parts[0] if len(parts) == 1 else torch.cat([x.to(dev) for x in parts])

    @functools.cached_property
    def tokens(self) -> torch.Tensor:
        return self._flat(lambda d: d.tokens)

    @functools.cached_property
    def parents(self) -> torch.Tensor:
        return self._flat(lambda d: d.tree.parents)

    def padded(self, n: int, device, *, rows: list[int] | None = None, batch: int | None = None) -> "StepBatch":
        """The trees as a verify pass reads them, n nodes a row (``StepBatch``): draft i at row ``rows[i]`` of
        ``batch`` rows (default: row i of as many as there are drafts), in a fixed number of tensor ops
        whatever the rows. Rows of one size, in order, are a view of the flat batch, with their trees' own
        depths and ancestor sets (one tree shared by every row, as a fixed tree is: expanded, not copied);
        otherwise the flat tokens and parents are scattered into place, a padding node a root of its own,
        and the depths and ancestor sets follow from the parents (``tree.tree_tensors``)."""
        R = len(self.rows)
        rows = list(range(R)) if rows is None else rows
        B = R if batch is None else batch
        tokens, parents = self.tokens.to(device), self.parents.to(device)
        if B == R and rows == list(range(R)) and all(m == n for m in self.sizes):
            trees = [d.tree for d in self.rows]
            if all(t is trees[0] for t in trees):
                depths, ancestors = (x.to(device).expand(B, *x.shape) for x in (trees[0].depths, trees[0].ancestors))
            else:
                depths = torch.stack([t.depths.to(device) for t in trees])
                ancestors = torch.stack([t.ancestors.to(device) for t in trees])
            return StepBatch(tokens=tokens.reshape(B, n), depths=depths, ancestors=ancestors, sizes=self.sizes)
        # node j of draft i goes to place rows[i] * n + j of the padded (B, n) layout
        place = torch.tensor([b * n + j for b, m in zip(rows, self.sizes) for j in range(m)], device=device)
        tokens = tokens.new_zeros(B * n).index_copy_(0, place, tokens).view(B, n)
        parents = parents.new_full((B * n,), -1).index_copy_(0, place, parents).view(B, n)
        depths, ancestors = tree_tensors(parents, max_depth=n - 1)
        return StepBatch(tokens=tokens, depths=depths, ancestors=ancestors, sizes=self.sizes)


@dataclass(frozen=True)
class StepBatch:
    """One step's trees as a verify pass reads them (``Drafts.padded``): draft i at row ``rows[i]``, n nodes
    each. A padding node (and every node of a row no draft fills) is token 0 at depth 0 and sees itself
    only, so it reads nothing real and nothing reads it."""

    tokens: torch.Tensor      # (batch, n) long
    depths: torch.Tensor      # (batch, n) long
    ancestors: torch.Tensor   # (batch, n, n) bool
    sizes: list[int]          # each draft's real nodes (drafts' order)


@dataclass
class TargetOut:
    logits: torch.Tensor   # (n, V) target logits after each node
    hidden: torch.Tensor   # (n, H) final post-norm hidden states
    captured: tuple[torch.Tensor, ...] = ()  # (1, n, H) after each layer in ``Drafter.capture_layers``


class Verified(Sequence[TargetOut]):
    """A verify pass's output for a step's rows: ``outs[i]`` is row i's ``TargetOut``, ``logits`` (N, V) every
    row's, flat in the order of the step's ``Drafts`` (row i's are a view of rows offsets[i] ..), and
    ``captured`` the pass's captured states whole ((P, n, H) each, padded), row i's at row ``at[i]``, so that
    a drafter gathers every row's in one op."""

    def __init__(self, rows: Sequence[TargetOut], logits: torch.Tensor, captured: tuple[torch.Tensor, ...] = (),
                 at: Sequence[int] = ()):
        self.rows, self.logits, self.captured, self.at = tuple(rows), logits, captured, list(at)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Drafter:
    """The contract every drafter keeps, batched: ``begin`` once for a decode's rows, then per step ``draft``
    for the live rows and ``commit`` of what they accepted. A drafter holds its per-row state itself, as
    lists or tensors indexed by ``DecodeState.row`` (a row's place in the batch, fixed for the decode; a
    finished row is simply not asked again). Subclasses implement ``draft``; the hooks default to nothing."""

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

    def begin(self, states: list[DecodeState], prefills: list[TargetOut]) -> None:
        """Called once after prefill with every row of the batch (``states[b].row == b``);
        ``prefills[b].hidden[-1]`` produced row b's pending token. Resets whatever a last decode left."""

    def draft(self, states: list[DecodeState]) -> Sequence[Draft]:
        """One step's drafts for the live rows ``states`` (in row order), one call for all of them: a ``Drafts``
        (a drafter that drafts every row at once lays their tokens and parents out flat), or a list of one
        ``Draft`` a row, which the loop makes one. A
        sampling drafter draws its candidates in a fixed order (stage by stage, row order within a
        stage), so that a batch consumes the generator as the loop expects."""
        raise NotImplementedError

    def commit(self, states: list[DecodeState], accepted: list[Accepted], outs: list[TargetOut]) -> None:
        """Called after the target committed each live row's ``accepted`` path (``states`` already updated;
        ``outs``: each row's verification output). A step the runtime did not draft (``plain_draft``) is
        committed too."""


def plain_draft(state: DecodeState, device: torch.device) -> Draft:
    """A step that drafts nothing: the pending token alone (plain decoding)."""
    return Draft(tree=build_tree((), str(device)), tokens=torch.tensor([state.ids[-1]], device=device))


class WidthFit(Protocol):
    """The seam through which a runtime cuts each step's trees to what its pass is worth on this machine
    (``runtime.width.VerifyCost``). A cut keeps the root and never widens a tree, so output stays exact.
    A drafter that drafts in stages may ask it whether one more stage pays (``level_pays``)."""

    def fit(self, drafts: list[Draft], widest: int, rows: int | None = None) -> list[Draft]: ...

    def observe(self, rows: int, width: int, accepted: list) -> None: ...   # the step fitted last is done and
    # accepted ``accepted`` (the runtime times it, and may learn from what its drafts were accepted with)

    def level_pays(self, chances: list[list[float]], children: list[list[float]], *, rows: int, widest: int,
                   running: int, depths: list[int] | None = None) -> bool: ...
    # one more stage, of ``running`` rows (the runtime times the stages); depths: each drafted chance's depth
    # (the same in every row), the children one deeper


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

    def verify(self, backbone: Backbone, cache: KVCache, pasts: list[int], drafts: Sequence[Draft], *,
               rows: list[int], capture: tuple[int, ...] = ()) -> Verified: ...
