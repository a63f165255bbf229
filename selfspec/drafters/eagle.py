"""EAGLE drafter: a one-layer feature head drafts a dynamic tree (EAGLE-3 head, EAGLE-2 tree).

The head (``models/eagle.py``) reads the target's hidden states after three of its layers, which
every target pass captures at no extra cost (``capture_layers``), and keeps its own KV cache with
the target's invariant: one slot per committed token but the pending one. Slot i holds what the
head made of token x_i's target features and the embedding of x_{i+1}; its output predicts
x_{i+2}. So after each step the accepted tokens' features (from the verification pass) fill their
slots, and the last slot's output gives the distribution of the token after the pending one:
the tree's first level.

Drafting ahead, the target has not seen the drafted tokens, so a drafted node's slot reads its
parent's output state instead of target features, and attends to the committed slots plus its
own draft ancestors (a tree mask over the head's cache), as in training (training-time test).

The tree, per step (EAGLE-2):
* level 1: the root's top ``expand`` candidates;
* level d + 1: the ``expand`` best nodes of level d (by path score) are run through the head in
  one call, and each proposes ``expand`` children;
* finally, the tree keeps the ``nodes`` best nodes of all drafted (path probabilities; a child never
  outscores its parent, so the kept set is a tree), and cuts those below ``threshold``; drafting
  stops early at a level whose best path is already below it (each level costs a head call),
  and, with width fitting on (``use_cost``), at a level not expected to pay on this machine:
  ``runtime.width.VerifyCost.level_pays`` weighs the tokens it is expected to add against the seconds the
  runtime measured levels to cost and the pass's cost curve.

Sampling drafts the same tree: the head's likeliest tokens, none of them drawn. Each is a certain
token (a point mass), accepted with the chance the target itself gives it and, where rejected, left
out of the residual its siblings are tried against (``accept.point_accept_tree``), so the output
keeps the target's distribution whatever the tree is and however it was cut. Drawing the children
from the head's distribution instead would be accepted with chance sum min(p, q), but keeps the tree
from being cut by its tokens' own chances (a cut must not depend on which tokens were drawn), and
the head's top guesses cover more of the target's mass than its draws.

A batch: the rows' head caches are the rows of one batched cache, each at its own length; each
level of every row's tree runs in one head call (a row whose best path fell below the threshold sits
that level out), and so do every row's accepted slots after a step (paths of different lengths
padded, the padding cut off). Every row gets the tree it would get alone.

Compiled (``use_step`` with a static verify step, ``compile=True``), the head drafts at static shapes
too (unless ``static_head=False``): its cache is preallocated with a row per batch row (a finished row idles in it), each
head call (a draft level of every row; a step's accepted slots, padded to a bucket) writes at
tensor slots and builds its mask from tensors, and runs as one function of fixed shapes, compiled
as the verify step is (a CUDA graph on GPU). Drafting and the trees it gives are unchanged.

With ``lookup`` = k > 0 a step also grafts up to k tokens copied from the context, or where it
has no match from the ``corpus`` (``lookup.with_lookup``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core import cache as kv
from ..core.accept import Accepted
from ..core.backbone import Backbone
from ..core.tree import Tree, additive_mask, check_dynamic_tree, subtree, tree_tensors
from ..core.types import DecodeState, Draft, Drafter, Drafts, TargetOut, VerifyStep, WidthFit
from ..corpus import Corpus
from ..heads import Heads, heads_in_dtype
from .base import check_lookup, check_threshold
from .lookup import with_lookup


@dataclass(frozen=True)
class _Pool:
    """Every node a step drafted, per row (node 0 = the root; level by level, as ``_grow`` appends them)."""

    tokens: torch.Tensor            # (R, P) token ids
    parents: torch.Tensor           # (R, P) pool id of each node's parent (root: -1)
    scores: torch.Tensor            # (R, P) log path probability
    levels: list[int]               # per row: levels drafted


def _level_layout(R: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """What every level after the first shares: each of its k * k nodes' parent's place among the k nodes run
    (R, k * k), and those k nodes' own places (R, k, 1)."""
    places = torch.arange(k, device=dev)
    return _each_k_times(places[None], k).expand(R, -1), places[None, :, None].expand(R, k, 1)


def _each_k_times(x: torch.Tensor, k: int) -> torch.Tensor:
    """(R, m, ...) -> (R, m * k, ...), each of the m entries k times in a row (``repeat_interleave`` on dim 1)."""
    return x[:, :, None].expand(x.shape[0], x.shape[1], k, *x.shape[2:]).reshape(x.shape[0], x.shape[1] * k, *x.shape[2:])


def _drafts(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, ranks: torch.Tensor,
            ancestors: torch.Tensor, path_p: torch.Tensor) -> Drafts:
    """Rows' trees of one size, as ``_kept_tree`` gives them ((R, n) each, ancestors (R, n, n)), as a step's
    flat batch: row b's draft reads row b of each, and the flat tokens and parents are the rows end to end."""
    rows = [Draft(tree=Tree(parents=parents[b], depths=depths[b], ranks=ranks[b], ancestors=ancestors[b]),
                  tokens=tokens[b], path_p=path_p[b]) for b in range(tokens.shape[0])]
    return Drafts(rows, tokens=tokens.reshape(-1), parents=parents.reshape(-1))


class EagleDrafter(Drafter):
    name = "eagle"
    static_step: "VerifyStep | None" = None   # the verify step the head's static passes match (use_step)
    _static = None                            # ``_static_pass``, compiled as that step is (``step.function``)
    _tree = None                              # ``_tree_pass`` (a step's whole draft), compiled likewise
    # Width fitting's prices (``use_cost``): with them, drafting stops at the level that would not pay.
    cost: "WidthFit | None" = None
    cost_rows: int | None = None              # the rows its passes run (a static step's); None: the live rows
    level_stop: bool = True                   # False: every level the tree spec allows, priced or not (A/B runs)

    def __init__(self, backbone: Backbone, heads: Heads, *, depth: int = 5, expand: int = 4, nodes: int = 8,
                 threshold: float = 0.0, lookup: int = 0, corpus: Corpus | None = None,
                 dtype: torch.dtype | None = None, static_head: bool | None = None):
        aux = tuple(heads.config.aux_layers)
        if len(aux) == 0 or not all(0 < a <= backbone.num_layers for a in aux):
            raise ValueError(f"eagle aux layers {aux} must lie between 1 and {backbone.num_layers}")
        self.backbone = backbone
        self.heads = heads
        # dtype: what the head drafts in (default: the target's); a copy when it differs from the loaded head's.
        self.dtype = dtype or backbone.dtype
        # Under a static verify step, whether the head runs static too (use_step); None: where it pays.
        if static_head not in (None, True, False):
            raise ValueError(f"static_head must be True, False or None (got {static_head!r})")
        self.static_head = static_head
        self.head = heads_in_dtype(heads, self.dtype).module
        self.depth, self.expand, self.nodes = check_dynamic_tree(depth, expand, nodes)
        self.threshold = check_threshold(threshold)
        self.log_threshold = math.log(self.threshold) if self.threshold > 0 else -math.inf
        self.lookup = check_lookup(lookup)
        self.corpus = corpus                           # where the lookup finds no context match (corpus.py)
        self.vocab = heads.draft_vocab                 # (V_draft,) draft id -> token id, or None
        self.capture_layers = aux
        self.cache = kv.new_cache()                    # the head's KV cache, a row per batch row (``begin``)
        self.committed: list[int] = []                 # per row: head cache slots that hold committed tokens
        self.root_state: list[torch.Tensor | None] = []   # per row: (1, 1, H) output of its last committed slot
        self._pending: list = []   # static: the last step's commit, left to the next draft's one call (``_commit_static``)
        self._layouts: dict = {}   # ``_pool_layout`` per pool depth
        self._weights = None       # the head's ``decoding_weights()`` for this decode (``begin``)

    @property
    def max_nodes(self) -> int:
        return 1 + self.nodes + self.lookup

    def use_cost(self, cost: "WidthFit | None", rows: int | None = None) -> None:
        self.cost, self.cost_rows = cost, rows

    def _level_pays(self, drafted: list[list[float]], children: list[list[float]], active: list[int],
                    levels: int) -> bool:
        """Whether one more level, run for the ``active`` rows, is expected to pay on this machine
        (``WidthFit.level_pays``, which times the levels itself). drafted[b]: row b's drafted chances so
        far, ``levels`` levels of them (pool order: level 1's ``expand`` nodes, then ``expand`` squared a
        level); children[b]: what its next level is expected to add (its ``expand`` best nodes' chances
        times the last level's mean top probability: what a child keeps of its parent's chance)."""
        on, k = set(active), self.expand
        depths = [1] * k + [d for d in range(2, levels + 1) for _ in range(k * k)]
        return self.cost.level_pays(drafted, [c if b in on else [] for b, c in enumerate(children)],
                                    rows=self.cost_rows or len(drafted), widest=self.max_nodes, running=len(active),
                                    depths=depths)

    # ------------------------------------------------------------------ the head's own cache
    def _run(self, feature: torch.Tensor, tokens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
             mask: torch.Tensor | None, rows: list[int]) -> torch.Tensor:
        """Slots for ``tokens`` (R, n) reading ``feature`` (R, n, H), at the positions whose rotary (cos, sin)
        is ``rope`` ((R, n or 1, 1, head_dim) each, ``_rope``; 1: every slot's), appended to rows ``rows`` of the head
        cache -> (R, n, H) output states."""
        emb = self.backbone.embed_tokens(tokens)
        emb = emb if emb.dtype == self.dtype else emb.to(self.dtype)
        return self.head.decode(feature, emb, rope, self.cache.rows(rows), mask, self._weights)

    def _rope(self, like: torch.Tensor, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary (cos, sin) of ``positions`` (R, n), all below ``top``, as ``_run`` reads them:
        (R, n, 1, head_dim) each."""
        cos, sin = self.backbone.rope(like, positions, top=top)
        return cos[:, :, None], sin[:, :, None]

    def _fill(self, row: int, captured: tuple[torch.Tensor, ...], nodes, tokens: torch.Tensor, start: int) -> None:
        """Row ``row``'s committed slots start.. from the target's features at ``nodes`` (a (m,) index; None:
        all) of a pass; tokens: the next token of each."""
        aux = captured[0] if len(captured) == 1 else torch.cat(captured, dim=-1)
        feature = self.head.fuse((aux if nodes is None else aux[:, nodes]).to(self.dtype))
        end = start + tokens.shape[0]
        rope = self._rope(feature, torch.arange(start, end, device=tokens.device)[None], end)
        states = self._run(feature, tokens[None], rope, None, [row])
        self.root_state[row] = states[:, -1:]
        self.committed[row] = start + tokens.shape[0]

    @torch.no_grad()
    def begin(self, states: list[DecodeState], prefills: list[TargetOut]) -> None:
        """The rows' head caches are the rows of one batched cache, so that a draft level runs all rows in one
        call; a static one (``use_step``) holds the target's static capacity plus one step's head slots."""
        if self.static_step is not None and self.cache is not None:
            self._head_storage.release(self.cache)   # the last decode's: its kept buffers are free again
        B = len(states)
        self._weights = self.head.decoding_weights()   # checked once a decode, not at every call
        self.cache = kv.new_cache(B) if self.static_step is None else self._head_storage.cache(B, self._head_capacity())
        self.committed, self.root_state, self._pending = [0] * B, [None] * B, []
        for s, out in zip(states, prefills):
            P = s.past_len                       # prompt positions 0..P-1; ids[P] is pending
            self._fill(s.row, out.captured, None, torch.tensor(s.ids[1:P + 1], device=self.backbone.device), 0)

    @torch.no_grad()
    def commit(self, states: list[DecodeState], accepted: list[Accepted], outs: Sequence[TargetOut]) -> None:
        """Every row's accepted slots in one head call: rows padded to the longest path, each row's
        queries masked to its own committed slots and its new ones (causal), the padding cut off after.
        ``outs``: the ``Verified`` the step's pass returned (its captured states are gathered whole)."""
        if self.static_step is not None:
            return self._commit_static(states, accepted, outs)
        dev = self.backbone.device
        if len(states) == 1:
            (s,), (a,), (out,) = states, accepted, outs
            start = self.committed[s.row]
            self.cache.row(s.row).truncate(start)    # drop this step's speculative slots
            nxt = torch.tensor(s.ids[start + 1: s.past_len + 1], device=dev)
            return self._fill(s.row, out.captured, torch.tensor(a.path, device=dev), nxt, start)
        rows = [s.row for s in states]
        starts = [self.committed[b] for b in rows]
        sizes = [len(a.path) for a in accepted]
        N = max(sizes)
        for b, start in zip(rows, starts):
            self.cache.row(b).truncate(start)                         # drop this step's speculative slots
        # Every row's accepted nodes' features in one gather from the pass's captured states (``Verified``),
        # each path padded by repeating its last node (padding slots: cut off below); their next tokens.
        at = [[b] * N for b in outs.at]                                                  # each row's pass row
        nodes = [list(a.path) + [a.path[-1]] * (N - len(a.path)) for a in accepted]       # its accepted nodes
        nxt = [s.ids[st + 1: s.past_len + 1] + [0] * (N - m) for s, st, m in zip(states, starts, sizes)]
        at, nodes, tokens = torch.tensor([at, nodes, nxt], device=dev)                    # (R, N) each, one copy
        feature = torch.cat([c[at, nodes] for c in outs.captured], dim=-1).to(self.dtype)   # (R, N, A * H)
        positions = torch.tensor(starts, device=dev)[:, None] + torch.arange(N, device=dev)
        visible = torch.arange(max(starts) + N, device=dev)[None, None, :] <= positions[:, :, None]        # (R, N, T)
        feature = self.head.fuse(feature)
        run = self._run(feature, tokens, self._rope(feature, positions, max(starts) + N),
                        additive_mask(visible, self.dtype), rows)
        for i, b in enumerate(rows):
            self.committed[b] += sizes[i]
            self.cache.row(b).truncate(self.committed[b])            # the padding slots of shorter paths
            self.root_state[b] = run[i: i + 1, sizes[i] - 1: sizes[i]]

    # ------------------------------------------------------------------ drafting
    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., V_draft) logits -> each row's ``expand`` likeliest draft ids and their log-probabilities (float32)."""
        logits = logits if logits.dtype == torch.float32 else logits.float()
        score, cand = logits.log_softmax(-1).topk(self.expand, dim=-1)
        return cand, score

    @torch.no_grad()
    def draft(self, states: list[DecodeState]) -> Drafts:
        """Every row's tree: each level of all rows in one head call, then the cut (``_cut``), as tensor ops
        on the model's device, greedy or sampling alike. Nothing is read back to the host unless a
        threshold is set or width fitting prices each level (``use_cost``): then one read of the level's
        scores per level, for all rows."""
        dev, k, R = self.backbone.device, self.expand, len(states)
        if self._tree is not None and self.threshold <= 0:
            return self._static_grow(states)
        reads = self.threshold > 0 or (self.cost is not None and self.level_stop)
        static = self.static_step is not None
        rows = [s.row for s in states]
        newest = max(self.committed[b] for b in rows)                                            # (host)
        committed, past, pending = torch.tensor([[self.committed[b] for b in rows], [s.past_len for s in states],
                                                 [s.ids[-1] for s in states]], device=dev)           # (R,) each
        root = torch.cat([self.root_state[b] for b in rows])   # (R, 1, H) each row's last committed slot's output
        H = root.shape[-1]
        # The pool of each row's drafted nodes, node 0 = the root, children appended level by level. Every
        # row has the same shape (k nodes at level 1, k * k at each later one), so node ids agree across rows.
        cand, score = self._candidates(self._logits(root[:, 0]))                              # (R, k)
        rho = score[:, 0].exp() if reads else None   # (R,) the last level's mean top probability (width fitting)
        tokens = [pending[:, None], self._to_ids(cand)]
        scores = [torch.zeros(R, 1, device=dev), score]
        bests = []   # per level run: its k nodes' places in the level before (R, k), whose children come next
        prev = root  # (R, m, H) output states of the last level run
        if static:   # the newest level's drafted ancestors' places, and its nodes' own
            anc, own = torch.zeros(R, k, 0, dtype=torch.long, device=dev), _level_layout(R, k, dev)[1]
        else:
            # Level d's nodes all sit at position past + d - 1: every level's rotary at once, split by level.
            cos, sin = self._rope(root, past[:, None] + torch.arange(self.depth - 1, device=dev),
                                  max(s.past_len for s in states) + self.depth)
            cos, sin = cos.split(1, dim=1), sin.split(1, dim=1)                   # (R, 1, 1, head_dim) a level
            # What each node of the newest level sees of the head cache, (R, m, T) additive: the root sees the
            # row's committed slots; a node sees what its parent sees and its own slot, level d's node j
            # committed + (d - 1) k + j.
            span = newest + (self.depth - 1) * k
            seen = torch.zeros(R, 1, span, dtype=self.dtype, device=dev).masked_fill_(
                torch.arange(span, device=dev) >= committed[:, None, None], torch.finfo(self.dtype).min)
            slots = (committed[:, None, None, None] +
                     torch.arange((self.depth - 1) * k, device=dev).view(-1, k, 1)).unbind(1)   # (R, k, 1) a level
        at = torch.arange(R, device=dev)[:, None]   # (R, 1): with a level's (R, k) places, each row's own nodes
        levels, active, a = [1] * R, list(range(R)), torch.arange(R, device=dev)
        for d in range(1, self.depth):
            if d == 1:   # level 1 is the root's candidates, best first already (``topk``): no sort, no gather
                top_scores, best, ids = scores[-1], torch.arange(k, device=dev).expand(R, -1), tokens[-1]
            else:
                ranked, order = torch.sort(scores[-1], dim=1, descending=True, stable=True)
                top_scores, best = ranked[:, :k], order[:, :k]                       # (R, k) the level's best k
                ids = tokens[-1].gather(1, best)
            if reads:   # one read for all rows (on a GPU, one synchronisation)
                n = sum(x.shape[1] for x in scores) - 1
                read = torch.cat(scores[1:] + [top_scores, rho.clamp(min=1e-30).log()[:, None]], 1).float().tolist()
                if self.threshold > 0:   # every deeper path of a row scores lower still: it drafts no further
                    active = [b for b in active if read[b][n] >= self.log_threshold]
                    if not active:
                        break
                if self.cost is not None and self.level_stop:
                    drafted = [[math.exp(x) for x in row[:n]] for row in read]
                    children = [[math.exp(x + row[-1]) for x in row[n:n + k]] for row in read]   # best nodes' x rho
                    if not self._level_pays(drafted, children, active, d):
                        break
                a = torch.tensor(active, device=dev)
            # Each runs in slot past + d - 1, reading its parent's output state (level 1's: the root's).
            place = best // k if d > 1 else None                                               # (R, k) parents'
            feature = prev[at, place] if d > 1 else prev.expand(-1, k, -1)
            if static:   # every row at the static shape; the inactive rows' states unused
                top_anc = anc.gather(1, best[..., None].expand(-1, -1, anc.shape[2]))           # (R, k, d - 1)
                anc = _each_k_times(torch.cat([top_anc, own], dim=2), k)   # the next level's
                run = self._static_level(rows, feature, ids, (past + d - 1)[:, None].expand(-1, k), committed,
                                         top_anc, d)[a]
            else:
                seen = (seen.repeat(1, k, 1) if d == 1 else seen[at, place]).scatter_(2, slots[d - 1], 0.0)
                if len(active) == R:
                    run = self._run(feature, ids, (cos[d - 1], sin[d - 1]), seen[:, None, :, : newest + d * k], rows)
                else:
                    top_slot = max(self.committed[rows[b]] for b in active) + d * k
                    run = self._run(feature[a], ids[a], (cos[d - 1][a], sin[d - 1][a]), seen[a, None, :, :top_slot],
                                    [rows[b] for b in active])
            prev = run if len(active) == R else run.new_zeros(R, k, H).index_copy_(0, a, run)
            cand, level = self._candidates(self._logits(run))                               # (A, k, k)
            A = len(active)
            if A < R:
                level = level.new_full((R, k, k), -math.inf).index_copy_(0, a, level)
                ids = torch.zeros(R, k * k, dtype=torch.long, device=dev).index_copy_(
                    0, a, self._to_ids(cand).reshape(A, k * k))
            else:
                ids = self._to_ids(cand).reshape(R, k * k)
            rho = level[:, :, 0].exp().mean(1) if reads else None
            tokens.append(ids)
            scores.append((top_scores[:, :, None] + level).reshape(R, k * k))
            bests.append(best)
            for b in active:
                levels[b] += 1
        pool = _Pool(tokens=torch.cat(tokens, 1), parents=self._pool_parents(bests, R), scores=torch.cat(scores, 1),
                     levels=levels)
        drafts = self._cut(pool) if self.threshold <= 0 and len(set(levels)) == 1 else \
            [self._cut_row(pool, b) for b in range(R)]
        return with_lookup(drafts, states, self.lookup, vocab_size=self.backbone.vocab_size, corpus=self.corpus)

    def _pool_parents(self, bests: list[torch.Tensor], R: int) -> torch.Tensor:
        """(R, P) each pool node's parent's pool id (the root's -1) from the places, in their level, of the k
        nodes each level after the first ran (``bests``, (R, k) each): a node of level d + 1 is a child of
        level d's node bests[d - 1][i // k]."""
        key = ("parents", len(bests), self.backbone.device)
        if key not in self._layouts:
            k, dev = self.expand, self.backbone.device
            first = torch.tensor([[-1] + [0] * k], device=dev)                       # the root, level 1
            starts = torch.tensor([1] + [1 + k + d * k * k for d in range(len(bests) - 1)], device=dev)[:, None]
            self._layouts[key] = first, starts                                     # (level d's first pool id)
        first, starts = self._layouts[key]
        if not bests:
            return first.expand(R, -1)
        groups = (torch.stack(bests, 1) + starts).view(R, -1)
        return torch.cat([first.expand(R, -1), _each_k_times(groups, self.expand)], 1)

    def _pool_layout(self, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a pool of L levels: each node's rank among its siblings and its depth, (P,) each."""
        if torch.compiler.is_compiling():   # (a compiled pass makes them as constants)
            return self._make_pool_layout(L)
        key = (L, self.backbone.device)
        if key not in self._layouts:
            self._layouts[key] = self._make_pool_layout(L)
        return self._layouts[key]

    def _make_pool_layout(self, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, dev = self.expand, self.backbone.device
        ranks = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.arange(k, device=dev)]
                          + [torch.arange(k, device=dev).repeat(k)] * (L - 1))
        depths = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.ones(k, dtype=torch.long, device=dev)]
                           + [torch.full((k * k,), d + 2, dtype=torch.long, device=dev) for d in range(L - 1)])
        return ranks, depths

    def _cut(self, pool: "_Pool") -> Drafts:
        """Every row's tree out of its pool, all rows at once on the device (every row drafted the pool's levels):
        the ``nodes`` best-scored nodes of the pool (EAGLE-2)."""
        tokens, parents, depths, ranks, ancestors, path_p = self._kept_tree(
            pool.tokens, pool.parents, pool.scores, self._best_nodes(pool.scores), pool.levels[0])
        return _drafts(tokens, parents, depths, ranks, ancestors, path_p)

    def _best_nodes(self, scores: torch.Tensor) -> torch.Tensor:
        """(R, P) pool scores -> (R, 1 + nodes) each row's root and its ``nodes`` best-scored nodes, in pool order.
        The root scores 0, the most any node can (a log probability); a child never outscores its parent and
        ties go to the lower pool id (the root's, a parent's), so the kept set is a tree."""
        best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : self.nodes + 1]
        return best.sort(dim=1).values

    def _kept_tree(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, nodes: torch.Tensor,
                   L: int) -> tuple[torch.Tensor, ...]:
        """Every row's tree of the pool nodes ``nodes`` (R, n) (``_best_nodes``: the root, then the kept nodes in
        pool order; a pool of L levels: tokens, parents, scores (R, P)): their tokens, parents renumbered to tree
        places, depths, ranks (R, n), ancestors (R, n, n) and path probabilities (R, n)."""
        # A node's tree parent is its pool parent's place among the row's nodes, which ascend and hold every kept
        # node's parent: the count of nodes at or below that id, less one (the root's parent, -1: none, so -1).
        tree_parents = torch.searchsorted(nodes, parents.gather(1, nodes), right=True) - 1
        ranks, depths = self._pool_layout(L)
        _, ancestors = tree_tensors(tree_parents, max_depth=L)
        return (tokens.gather(1, nodes), tree_parents, depths[nodes], ranks[nodes], ancestors,
                scores.gather(1, nodes).exp())

    def _cut_row(self, pool: "_Pool", b: int) -> Draft:
        """``_cut`` for one row whose pool differs from the others' (a threshold: on the host, row by row)."""
        k, L = self.expand, pool.levels[b]
        dev = pool.tokens.device
        n = 1 + k + (L - 1) * k * k                 # this row's pool
        score_b, parents_b = pool.scores[b, :n], pool.parents[b, :n]
        keep = torch.sort(-score_b[1:], stable=True).indices[: self.nodes] + 1
        if self.threshold > 0:
            keep = keep[score_b[keep].exp() >= self.threshold]
            keep = keep[self._closed(keep, parents_b)]
        keep, _ = torch.sort(keep)                     # pool order: parents before children
        nodes = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), keep])
        tree = subtree(parents_b, self._pool_layout(L)[0][:n], nodes, max_depth=self.depth)
        return Draft(tree=tree, tokens=pool.tokens[b, nodes], path_p=score_b[nodes].exp())

    # ------------------------------------------------------------------ static shapes (compile=True)
    def use_step(self, step: VerifyStep | None) -> None:
        """Decode with ``step`` (None: eagerly): the head's calls then run at static shapes, compiled as it is
        (``compile=True`` compiles the draft levels with the verify pass), unless ``static_head=False``."""
        static = self.static_head is not False
        if step is None or not static:
            self.static_step = self._static = self._tree = None
        elif step is not self.static_step:
            self.static_step, self._static = step, step.function(self._static_pass)
            self._tree = step.function(self._tree_pass)
            self._head_storage = kv.StaticStorage(static_address=step.compiled)   # as the step keeps its cache's

    def _head_capacity(self) -> int:
        """Slots per row of the static head cache: the verify step's capacity plus one step's draft levels
        and a padded commit."""
        return self.static_step.capacity + self.depth * self.expand + self.static_step.bucket(self.max_nodes)

    def _longest_path(self) -> int:
        """The most slots one step can commit: a tree's deepest path (drafted or copied) plus its root."""
        return 1 + max(self.depth, self.lookup)

    @torch.inference_mode()   # as decode_rows runs (a compiled pass guards on the mode)
    def warm_up(self, step: VerifyStep, *, batch: int = 1, sampled: bool = False) -> None:
        """Compile now every static head pass decoding batches of ``batch`` rows with ``step`` (its capacity
        reserved) can run: a step's whole draft (``_tree_pass``) or, under a threshold, a draft
        level, and a commit at every bucket an accepted path can fill."""
        self.use_step(step)
        if self._static is None:
            return
        attn, dev, k = self.head.midlayer.self_attn, self.backbone.device, self.expand
        self.cache = None     # compiled on the buffers decoding will use (``begin`` takes the same)
        cache = self._head_storage.cache(batch, self._head_capacity())
        cache.allocate(1, attn.num_kv_heads, attn.head_dim, dtype=self.dtype, device=dev)
        keys, values = cache.keys, cache.values
        H, A = self.head.fc.weight.shape[0], self.head.fc.weight.shape[1]
        idx = lambda n: torch.arange(n, device=dev)[None].repeat(batch, 1)   # noqa: E731
        if self.threshold > 0:
            self._static(keys, values, torch.zeros(batch, k, H, dtype=self.dtype, device=dev), idx(k), idx(k), idx(k),
                         idx(k), idx(k)[..., None].repeat(1, 1, self.depth), False)
            buckets = {self.static_step.bucket(m) for m in range(1, self._longest_path() + 1)}
        else:   # a whole-tree pass with a commit padded to the longest path; that commit alone (a plain step's)
            n = self.static_step.bucket(self._longest_path())
            longs = lambda: torch.zeros(batch, dtype=torch.long, device=dev)   # noqa: E731  (no two inputs alias)
            self._tree(keys, values, torch.zeros(batch, n, A, dtype=self.dtype, device=dev), idx(n), idx(n), idx(n), idx(n),
                       longs(), torch.zeros(batch, H, dtype=self.dtype, device=dev), longs(), longs(), longs() + 1)
            buckets = {n}
        for n in sorted(buckets):   # (no two inputs alias, as in decoding)
            self._static(keys, values, torch.zeros(batch, n, A, dtype=self.dtype, device=dev), idx(n), idx(n), idx(n),
                         idx(n), idx(n)[..., None], True)
        self._head_storage.release(cache)

    def _static_pass(self, keys: list[torch.Tensor], values: list[torch.Tensor], x: torch.Tensor, tokens: torch.Tensor,
                     positions: torch.Tensor, slots: torch.Tensor, limit: torch.Tensor, vis: torch.Tensor,
                     fuse: bool) -> torch.Tensor:
        """One head call on every row of the static head cache: n slots per row (tokens, positions: (B, n))
        written at ``slots`` (B, n); slot i of row b sees the slots below limit[b, i] and those in vis[b, i]
        (B, n, S). x: the target's aux features (B, n, A*H) to fuse (``fuse``) or output states (B, n, H).
        Returns (B, n, H) output states. Every shape is fixed by (B, n, S, the cache's capacity)."""
        bb = self.backbone
        B, n = tokens.shape
        feature = self.head.fuse(x) if fuse else x
        emb = bb.embed(tokens.reshape(-1)).view(B, n, -1).to(self.dtype)
        t = torch.arange(keys[0].shape[2], device=tokens.device)
        visible = (t < limit[..., None]) | (vis[..., None] == t).any(2)                       # (B, n, C)
        rows = torch.arange(B, device=tokens.device)[:, None].expand(B, n)
        return self.head(feature, emb, position_embeddings=bb.rotary_emb(feature, position_ids=positions),
                         cache=kv.SlotWriter(keys, values, rows, slots), attention_mask=additive_mask(visible, self.dtype))

    def _tree_pass(self, keys: list[torch.Tensor], values: list[torch.Tensor], aux: torch.Tensor, ctokens: torch.Tensor,
                   cpositions: torch.Tensor, cslots: torch.Tensor, climit: torch.Tensor, sizes: torch.Tensor,
                   root: torch.Tensor, pending: torch.Tensor, committed: torch.Tensor,
                   past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A step's head work for every row of the static head cache in one pass: the last step's
        accepted slots (``_commit_static``'s inputs aux .. climit, sizes (B,) how many are real per row, 0:
        none, the root state is ``root`` (B, H)), then ``depth`` levels grown, scored and cut as ``_grow`` and
        ``_cut`` do (the same trees, in the same node order), with nothing read back. pending: (B,) each
        row's pending token; committed: (B,) its committed head slots, that commit's included (level d's
        node j writes slot committed + (d - 1) k + j); past: (B,) the target's past length. Returns the
        trees' tokens, parents, depths, ranks (B, n), ancestors (B, n, n) and path probabilities (B, n)."""
        bb, k, dev = self.backbone, self.expand, root.device
        B, H = root.shape
        run = self._static_pass(keys, values, aux, ctokens, cpositions, cslots, climit, cslots[..., None], True)
        last = run.gather(1, (sizes - 1).clamp(min=0)[:, None, None].expand(-1, 1, H))[:, 0]
        root = torch.where((sizes > 0)[:, None], last, root)
        t = torch.arange(keys[0].shape[2], device=dev)
        rows = torch.arange(B, device=dev)[:, None].expand(B, k)
        cand, score = self._candidates(self._logits(root))
        tokens = [pending[:, None], self._to_ids(cand)]
        parents = [torch.full((B, 1), -1, device=dev), torch.zeros(B, k, dtype=torch.long, device=dev)]
        scores = [torch.zeros(B, 1, device=dev), score]
        prev, fidx = root[:, None], torch.zeros(B, k, dtype=torch.long, device=dev)
        parent_place, own_place = _level_layout(B, k, dev)
        anc = torch.zeros(B, k, 0, dtype=torch.long, device=dev)     # as in ``_grow``
        start = 1
        for d in range(1, self.depth):
            best = torch.sort(-scores[-1], dim=1, stable=True).indices[:, :k]
            top_scores, top = scores[-1].gather(1, best), start + best
            top_anc = anc.gather(1, best[..., None].expand(-1, -1, d - 1))
            feature = prev.gather(1, fidx.gather(1, best)[..., None].expand(-1, -1, H))
            own = committed[:, None] + (d - 1) * k + torch.arange(k, device=dev)                  # (B, k)
            seen = torch.cat([committed[:, None, None] + torch.arange(d - 1, device=dev) * k + top_anc, own[..., None]], 2)
            visible = (t < committed[:, None, None]) | (seen[..., None] == t).any(2)             # (B, k, C)
            emb = bb.embed(tokens[-1].gather(1, best).reshape(-1)).view(B, k, -1).to(self.dtype)
            positions = (past + d - 1)[:, None].expand(-1, k)
            prev = self.head(feature, emb, position_embeddings=bb.rotary_emb(feature, position_ids=positions),
                             cache=kv.SlotWriter(keys, values, rows, own),
                             attention_mask=additive_mask(visible, self.dtype))
            cand, score = self._candidates(self._logits(prev.reshape(-1, H)))
            tokens.append(self._to_ids(cand).reshape(B, k * k))
            parents.append(_each_k_times(top, k))
            scores.append((top_scores[:, :, None] + score.view(B, k, k)).reshape(B, k * k))
            fidx = parent_place
            anc = _each_k_times(torch.cat([top_anc, own_place], dim=2), k)
            start += tokens[-2].shape[1]
        pool, pool_parents, pool_scores = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)
        nodes = self._best_nodes(pool_scores)   # as ``_cut``
        return self._kept_tree(pool, pool_parents, pool_scores, nodes, self.depth)

    def _static_grow(self, states: list[DecodeState]) -> Drafts:
        """``_grow`` at static shapes: the live rows' whole drafts in one call of ``_tree_pass``
        over every row of the head cache (an idle row drafts at the top slots, which no row reads)."""
        dev, k, B = self.backbone.device, self.expand, self.cache.batch
        C = self.cache.keys[0].shape[2]
        H, A = self.head.fc.weight.shape
        root = torch.zeros(B, H, dtype=self.dtype, device=dev)
        if self._pending:   # the last step's commit, run first in the same call
            commit, sizes = self._pending
            self._pending.clear()
        else:               # none (the first step): no real slot; what it writes lies where the drafts write
            N = self.static_step.bucket(self._longest_path())
            slots = torch.arange(C - N, C, device=dev).repeat(B, 1)
            commit = (torch.zeros(B, N, A, dtype=self.dtype, device=dev), torch.zeros(B, N, dtype=torch.long, device=dev),
                      slots.clone(), slots, slots + 1)
            sizes = torch.zeros(B, dtype=torch.long, device=dev)
            root.index_copy_(0, torch.tensor([s.row for s in states], device=dev),
                             torch.cat([self.root_state[s.row][:, 0] for s in states]))
        live = [s.row for s in states]
        pending = self._at_rows(live, [s.ids[-1] for s in states], 0)
        committed = self._at_rows(live, [self.committed[b] for b in live], C - self.depth * k)   # (idle: the top slots)
        past = self._at_rows(live, [s.past_len for s in states], 0)
        tokens, parents, depths, ranks, ancestors, path_p = self._tree(
            self.cache.keys, self.cache.values, *commit, sizes, root, pending, committed, past)
        if live != list(range(B)):   # (the idle rows' trees are no one's)
            at = torch.tensor(live, device=dev)
            tokens, parents, depths, ranks, ancestors, path_p = (
                x.index_select(0, at) for x in (tokens, parents, depths, ranks, ancestors, path_p))
        return with_lookup(_drafts(tokens, parents, depths, ranks, ancestors, path_p), states, self.lookup,
                           vocab_size=self.backbone.vocab_size, corpus=self.corpus)

    def _at_rows(self, live: list[int], values: list[int], idle: int) -> torch.Tensor:
        """(B,) long over every row of the head cache: ``values`` at rows ``live``, ``idle`` at the others."""
        dev = self.backbone.device
        if live == list(range(self.cache.batch)):
            return torch.tensor(values, dtype=torch.long, device=dev)
        return torch.full((self.cache.batch,), idle, dtype=torch.long, device=dev).index_copy_(
            0, torch.tensor(live, device=dev), torch.tensor(values, dtype=torch.long, device=dev))

    def _padded(self, live: list[int], rows: torch.Tensor, *xs: torch.Tensor, idle_slots: torch.Tensor) -> list[torch.Tensor]:
        """The live rows' inputs (first dim R) placed at their rows ``live`` (``rows`` on the device) of the
        head cache; the idle rows (finished sequences) get zeros, except their slots (``xs[0]``): ``idle_slots``
        (n,), past anything they will read."""
        if live == list(range(self.cache.batch)):   # every row live, in order: nothing to pad
            out, seen = [], set()   # (an input given twice, or not contiguous, is copied: the callers' are fresh)
            for x in xs:
                out.append(x if x.is_contiguous() and id(x) not in seen else x.contiguous().clone())
                seen.add(id(x))
            return out
        out = []
        for i, x in enumerate(xs):
            full = (idle_slots.expand(self.cache.batch, *x.shape[1:]) if i == 0
                    else x.new_zeros(self.cache.batch, *x.shape[1:])).clone()
            full[rows] = x
            out.append(full)
        return out

    def _static_level(self, live: list[int], feature: torch.Tensor, tokens: torch.Tensor,
                      positions: torch.Tensor, committed: torch.Tensor, anc: torch.Tensor, d: int) -> torch.Tensor:
        """Level d of the live rows ``live`` (R of them) at the static shape -> (R, k, H) output states. Node j of a
        row writes slot committed + (d - 1) k + j (as eagerly) and sees the committed slots, its drafted
        ancestors' (anc: (R, k, d - 1), their places in levels 1 .. d - 1) and its own, listed in
        ``depth`` entries (the own slot repeated) so that every level has one shape."""
        k, dev = self.expand, feature.device
        own = committed[:, None] + (d - 1) * k + torch.arange(k, device=dev)                  # (R, k)
        ancs = committed[:, None, None] + torch.arange(d - 1, device=dev)[None, None] * k + anc
        vis = torch.cat([ancs, own[..., None].expand(-1, -1, self.depth - d + 1)], dim=2)    # (R, k, depth)
        C = self.cache.keys[0].shape[2]
        rows = torch.tensor(live, device=dev)
        slots, feature, tokens, positions, limit, vis = self._padded(
            live, rows, own, feature.to(self.dtype), tokens, positions, committed[:, None].expand(-1, k), vis,
            idle_slots=torch.arange(C - k, C, device=dev))
        run = self._static(self.cache.keys, self.cache.values, feature, tokens, positions, slots, limit, vis, False)
        return run[rows]

    def _commit_static(self, states: list[DecodeState], accepted: list[Accepted], outs: list[TargetOut]) -> None:
        """``commit`` at the static shape: every row's accepted slots in one call, padded to a bucket
        (the padding's slots lie where the next step's drafts write before anything reads them)."""
        dev = self.backbone.device
        sizes = [len(a.path) for a in accepted]
        fused = self._tree is not None and self.threshold <= 0
        self._flush()   # a commit the last step left to a draft that never ran (a plain step)
        # Fused (the next draft is a whole-tree pass): padded to the longest path, so the pass has one shape.
        N = self.static_step.bucket(max(sizes) if not fused else max(self._longest_path(), *sizes))
        live = [s.row for s in states]
        starts = [self.committed[b] for b in live]
        aux = torch.zeros(len(states), N, sum(c.shape[-1] for c in outs[0].captured), dtype=self.dtype, device=dev)
        tokens = torch.zeros(len(states), N, dtype=torch.long, device=dev)
        for i, (s, a, out) in enumerate(zip(states, accepted, outs)):
            aux[i, : sizes[i]] = torch.cat([c[0, list(a.path)] for c in out.captured], dim=-1).to(self.dtype)
            tokens[i, : sizes[i]] = torch.tensor(s.ids[starts[i] + 1: s.past_len + 1], device=dev)
        positions = torch.tensor(starts, device=dev)[:, None] + torch.arange(N, device=dev)
        C = self.cache.keys[0].shape[2]
        rows = torch.tensor(live, device=dev)
        slots, positions, aux, tokens, limit = self._padded(
            live, rows, positions, positions, aux, tokens, positions + 1, idle_slots=torch.arange(C - N, C, device=dev))
        commit = (aux, tokens, positions, slots, limit)
        # Fused: run by the next step's draft, in its one call (``_tree_pass``); else now (``_flush``).
        self._pending[:] = [commit, self._at_rows(live, sizes, 0)]   # (idle rows: no real slot)
        for i, b in enumerate(live):
            self.committed[b] += sizes[i]
            self.root_state[b] = None
            self.cache.lengths[0][b] = self.committed[b]   # the host's view (``KVCache.layer``) follows
        if not fused:
            self._flush()

    def _flush(self) -> None:
        """Run the commit a fused step left pending (``_commit_static``) on its own: every row's root state."""
        if not self._pending:
            return
        (aux, tokens, positions, slots, limit), sizes = self._pending
        self._pending.clear()
        run = self._static(self.cache.keys, self.cache.values, aux, tokens, positions, slots, limit,
                           slots[..., None].clone(), True)
        root = run.gather(1, (sizes - 1).clamp(min=0)[:, None, None].expand(-1, 1, run.shape[-1]))   # (B, 1, H)
        for b in range(len(self.root_state)):
            self.root_state[b] = root[b: b + 1]

    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        """(r, H) output states -> (r, V_draft) draft logits."""
        return self.head.logits(states, None if torch.compiler.is_compiling() else self._weights)

    @staticmethod
    def _closed(keep: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Which of ``keep`` have every ancestor kept too (a threshold cut must leave a tree)."""
        kept = torch.zeros(parents.shape[0], dtype=torch.bool, device=keep.device)
        kept[0] = True
        kept[keep] = True
        ok = torch.ones(keep.shape[0], dtype=torch.bool, device=keep.device)
        up = parents[keep]
        while bool((up > 0).any()):
            ok &= kept[up.clamp(min=0)]
            up = torch.where(up > 0, parents[up.clamp(min=0)], up)
        return ok

    def _to_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.vocab is None else self.vocab[draft_ids]

