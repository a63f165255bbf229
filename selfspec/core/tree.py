"""Candidate trees: the shape of a draft, as data.

A tree is a tuple of *paths*. Node 0 is the root: the pending token, already chosen by the
target and not yet in the KV cache. Every other node is named by its path of child ranks from
the root: ``(0,)`` is the root's best candidate, ``(1,)`` its second, ``(0, 2)`` the third
candidate under ``(0,)``. A chain of k drafts is ``((0,), (0, 0), ..., (0,) * k)``.

Node order is the order the paths are given in (parents must come before children), so a
drafter can choose an order that suits it (early exit puts its chain first, see
``drafters/early_exit.py``). ``build_tree`` turns the paths into everything the verifier and
the acceptance rules need, once per shape.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Path = tuple[int, ...]


@dataclass(frozen=True)
class Tree:
    """Tensors the verifier and acceptance rules read; the Python views (paths, children, node
    paths) are derived on first use only, so a drafter that builds a new tree every step from a
    parent array (``tree_from_parents``) pays for tensor ops alone."""

    parents: torch.Tensor       # (n,) long; parents[0] = -1; parents precede children
    depths: torch.Tensor        # (n,) long; root depth 0
    ranks: torch.Tensor         # (n,) long; rank of the node among its parent's candidates (root: 0)
    ancestors: torch.Tensor     # (n, n) bool; [i, j] = j is i or an ancestor of i

    @functools.cached_property
    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """(parents, depths, ranks) as Python lists: one read (none for a tree ``build_tree`` made)."""
        parents, depths, ranks = torch.stack([self.parents, self.depths.to(self.parents.dtype),
                                              self.ranks.to(self.parents.dtype)]).tolist()
        return parents, depths, ranks

    @functools.cached_property
    def node_paths(self) -> tuple[tuple[int, ...], ...]:
        """node_paths[i] = node ids from the root to i, inclusive."""
        return tuple(self.path_to(i) for i in range(self.size))

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i] = node ids, in rank order."""
        ranks, kids = self.lists[2], [[] for _ in range(self.size)]
        for i, p in enumerate(self.lists[0][1:], start=1):
            kids[p].append(i)
        return tuple(tuple(sorted(c, key=lambda j: ranks[j])) for c in kids)

    @functools.cached_property
    def paths(self) -> tuple[Path, ...]:
        """Node i >= 1 as its path of ranks from the root (``paths[i - 1]``)."""
        ranks = self.lists[2]
        return tuple(tuple(ranks[j] for j in self.path_to(i)[1:]) for i in range(1, self.size))

    def path_to(self, node: int) -> tuple[int, ...]:
        """Node ids from the root to ``node``, inclusive (a walk of depth steps)."""
        walk, parents = [], self.lists[0]
        while node >= 0:
            walk.append(node)
            node = parents[node]
        return tuple(reversed(walk))

    @functools.cached_property
    def table_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each non-root node's candidate sits in a table of one row per depth, one column per rank:
        (depth - 1, rank), (n - 1,) each (a drafter that drafts one distribution per depth lays it out so)."""
        return self.depths[1:] - 1, self.ranks[1:]

    @functools.cached_property
    def path_weights(self) -> torch.Tensor:
        """(n, n) float ancestors: ``path_weights @ log f`` sums a per-node log factor along each node's path."""
        return self.ancestors.float()

    @property
    def size(self) -> int:
        return self.parents.shape[0]

    @functools.cached_property
    def depth(self) -> int:
        """The deepest node's depth (from ``lists`` where they are known: no read)."""
        return max(self.lists[1]) if "lists" in self.__dict__ else int(self.depths.max())

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    def width_at(self, depth: int) -> int:
        """Most candidates any node at ``depth - 1`` asks for at ``depth`` (how many to pick per row)."""
        return 1 + max((p[-1] for p in self.paths if len(p) == depth), default=-1)

    def attention_mask(self, past_len: int, *, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask (1, 1, n, past_len + n): every node sees the whole past and its own ancestors."""
        hidden = self.__dict__.get("_hidden")   # (kept: a shipped tree's, every step)
        if hidden is None:
            hidden = self.__dict__["_hidden"] = ~self.ancestors
        mask = torch.zeros(1, 1, self.size, past_len + self.size, dtype=dtype, device=hidden.device)
        mask[..., past_len:].masked_fill_(hidden, torch.finfo(dtype).min)
        return mask

    def position_ids(self, past_len: int) -> torch.Tensor:
        """(1, n): the root sits at ``past_len``, a node at depth d at ``past_len + d``."""
        return (self.depths + past_len)[None]


def tree_mask(ancestors: torch.Tensor, lengths: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (B, 1, q, slots) mask of a batch of trees verified in one pass: row b's queries see its
    cache slots [0, lengths[b]) and, among its n tree slots from lengths[b] on, those ``ancestors[b]``
    (B, q, n) allows (q = n: a query per node; fewer: some of the nodes' rows); slots past a row's tree are
    hidden. Tensor ops only, so a static pass builds it too."""
    q, n = ancestors.shape[1], ancestors.shape[2]
    rel = torch.arange(slots, device=lengths.device)[None] - lengths[:, None]             # (B, slots)
    in_tree = (rel >= 0) & (rel < n)
    tree = ancestors.gather(2, rel.clamp(0, n - 1)[:, None].expand(-1, q, -1)) & in_tree[:, None]
    vis = (rel < 0)[:, None] | tree                                                        # (B, q, slots)
    return torch.where(vis, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, T) bool (True = may attend) -> (1, 1, n, T) additive mask, or (B, n, T) -> (B, 1, n, T): 0 where
    visible, dtype's min elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None] if visible.dim() == 2 else mask[:, None]


def chain(k: int) -> tuple[Path, ...]:
    return tuple((0,) * d for d in range(1, k + 1))


def chain_with_siblings(k: int, width: int) -> tuple[Path, ...]:
    """A greedy chain of k, plus ``width - 1`` alternative leaves at every depth; chain nodes first."""
    spine = chain(k)
    leaves = tuple((0,) * (d - 1) + (r,) for d in range(1, k + 1) for r in range(1, width))
    return spine + leaves


@functools.lru_cache(maxsize=1024)
def build_tree(paths: tuple[Path, ...], device: str = "cpu") -> Tree:
    """Pure builder, cached on the (hashable) shape and device."""
    paths = tuple(tuple(int(r) for r in p) for p in paths)
    index = {(): 0}
    parents, depths, ranks = [-1], [0], [0]
    for i, p in enumerate(paths, start=1):
        if not p or any(r < 0 for r in p):
            raise ValueError(f"tree path {p!r} must be a non-empty tuple of non-negative ranks")
        if p in index:
            raise ValueError(f"tree path {p!r} appears twice")
        if p[:-1] not in index:
            raise ValueError(f"tree path {p!r} comes before its parent {p[:-1]!r}: list parents first")
        index[p] = i
        parents.append(index[p[:-1]])
        depths.append(len(p))
        ranks.append(p[-1])
    tree = tree_from_parents(torch.tensor(parents, device=torch.device(device)),
                             torch.tensor(ranks, device=torch.device(device)), max_depth=max(depths))
    tree.__dict__["paths"] = paths   # known already: spare the derivation, and the reads
    tree.__dict__["lists"] = (parents, depths, ranks)
    return tree


def tree_from_parents(parents: torch.Tensor, ranks: torch.Tensor, *, max_depth: int) -> Tree:
    """A tree from a parent array (parents[0] = -1, parents[i] < i) with tensor ops only (``tree_tensors``)."""
    depths, ancestors = tree_tensors(parents[None], max_depth=max_depth)
    return Tree(parents=parents, depths=depths[0], ranks=ranks, ancestors=ancestors[0])


def tree_tensors(parents: torch.Tensor, *, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths (B, n) and ancestor sets (B, n, n) of a batch of trees given by parent arrays (B, n)
    (parents[:, 0] = -1, parents[b, i] < i, no node deeper than ``max_depth``), on their device with no
    host read. With S = I + (each node's parent), entry (i, j) of S^m counts the ways up from i to j in m
    moves that each stay or go to the parent: C(m, d) for an ancestor d levels up, at most m of them, and 0
    otherwise; so S^max_depth is nonzero exactly at every node's ancestors and itself. Its entries are at most
    2^max_depth: within float32's range to 120 levels, float64's beyond."""
    B, n = parents.shape
    m = max(1, min(max_depth, n - 1))
    dtype = torch.float32 if m <= 120 else torch.float64
    idx = torch.arange(n, device=parents.device)
    step = torch.eye(n, dtype=dtype, device=parents.device) + (parents[..., None] == idx)          # (B, n, n)
    reach = torch.linalg.matrix_power(step, m) > 0
    return reach.sum(-1) - 1, reach


def subtree(parents: torch.Tensor, ranks: torch.Tensor, keep: torch.Tensor, *, max_depth: int) -> Tree:
    """The tree of the nodes ``keep`` (ascending ids, 0 first) of the tree given by ``parents`` and
    ``ranks`` (n,), renumbered 0.. in that order. Every kept node's parent must be kept too."""
    new_id = torch.full((parents.shape[0],), -1, dtype=torch.long, device=parents.device)
    new_id[keep] = torch.arange(keep.shape[0], device=parents.device)
    sub = torch.cat([parents.new_tensor([-1]), new_id[parents[keep[1:]]]])
    if bool((sub[1:] < 0).any()):
        raise AssertionError("a kept node's parent was cut: a subtree must be closed under parents")
    return tree_from_parents(sub, ranks[keep], max_depth=max_depth)


def path_probs(tree: Tree, conf: torch.Tensor | Sequence[float]) -> list[float]:
    """The product of ``conf`` (n,) (the draft's probability of each node given its parent; a tensor, or
    a list the host holds already) along each node's path; the root's is 1. Summed over a tree's nodes
    it is the number of its tokens the draft expects accepted (siblings are exclusive, so at most one
    path is accepted)."""
    c, parents = conf.tolist() if isinstance(conf, torch.Tensor) else list(conf), tree.lists[0]
    out = [1.0] * tree.size
    for i in range(1, tree.size):  # parents come before children
        out[i] = out[parents[i]] * c[i]
    return out


def prune(tree: Tree, conf: torch.Tensor | Sequence[float], threshold: float, gate: float = 0.0) -> tuple[Path, ...]:
    """The paths of ``tree`` a draft is confident enough to propose: a pure function.

    conf: (n,) the draft's probability for each node given its parent (root ignored), a tensor or a list.
    threshold: a node is kept when its path probability is >= threshold and its parent is kept,
    so the result is prefix-closed, in the tree's own node order (0 keeps every node).
    gate: then the whole tree is dropped unless the kept nodes' expected accepted tokens (their
    summed path probabilities) reach ``gate`` (0: never dropped).

    On a CPU, verifying even one draft node costs most of an extra decode step (small matrix
    products run barely faster per row than one-row ones), and an early-exit chain node costs half
    a step to draft: a draft the draft itself gives little chance is cheaper not proposed.
    Pruning never changes which tokens are committed (acceptance still decides).
    """
    if threshold <= 0 and gate <= 0:
        return tree.paths
    probs, parents = path_probs(tree, conf), tree.lists[0]
    keep = [True] + [False] * (tree.size - 1)
    for i in range(1, tree.size):
        keep[i] = keep[parents[i]] and probs[i] >= threshold
    if gate > 0 and sum(probs[i] for i in range(1, tree.size) if keep[i]) < gate:
        return ()
    return tuple(p for i, p in enumerate(tree.paths, start=1) if keep[i])


def tree_from_rank_accuracy(acc: tuple[tuple[float, ...], ...], size: int) -> tuple[Path, ...]:
    """The ``size`` candidate nodes with the highest estimated probability of being accepted.

    acc[d][r]: measured probability that the rank-r candidate at depth d + 1 is the target's
    token (e.g. Medusa head d + 1's top-k on held-out data). A path's probability is the product
    along it (heads treated as independent, as Medusa's tree search does); the expected tokens
    per step are 1 + the sum over chosen nodes. Best-first growth keeps the tree prefix-closed.
    """
    import heapq

    if size < 1:
        raise ValueError("a tree needs at least one candidate node")
    frontier = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(frontier)
    chosen: list[tuple[Path, float]] = []
    while frontier and len(chosen) < size:
        neg, path = heapq.heappop(frontier)
        chosen.append((path, -neg))
        d = len(path)
        if d < len(acc):
            for r, a in enumerate(acc[d]):
                heapq.heappush(frontier, (neg * a, path + (r,)))
    # Parents before children (depth, then rank order), as build_tree requires.
    return tuple(sorted((p for p, _ in chosen), key=lambda p: (len(p), p)))


def parse_tree(spec, *, default: tuple[Path, ...]) -> tuple[Path, ...]:
    """``"auto"`` -> default; ``"chain-K"``; ``"chain-K-wW"`` (chain + W-1 sibling leaves); or explicit paths."""
    if spec is None or spec == "auto":
        return default
    if isinstance(spec, str):
        parts = spec.split("-")
        try:
            if parts[0] == "chain" and len(parts) == 2:
                return chain(int(parts[1]))
            if parts[0] == "chain" and len(parts) == 3 and parts[2].startswith("w"):
                return chain_with_siblings(int(parts[1]), int(parts[2][1:]))
        except ValueError:
            pass
        raise ValueError(f"unknown tree {spec!r}: use 'auto', 'chain-K', 'chain-K-wW' or a list of paths")
    return tuple(tuple(p) for p in spec)


def check_dynamic_tree(depth: int, expand: int, nodes: int) -> tuple[int, int, int]:
    for name, v in (("depth", depth), ("expand", expand), ("nodes", nodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"eagle tree {name} must be a whole number >= 1 (got {v!r})")
    return depth, expand, nodes


def parse_dynamic_tree(spec) -> dict:
    """``"dynamic-D-K-M"`` (depth D, expand K per level, keep M nodes) or a dict of those -> EagleDrafter kwargs."""
    if isinstance(spec, dict):
        d, k, m = spec.get("depth"), spec.get("expand"), spec.get("nodes")
    else:
        parts = str(spec).split("-")
        try:
            if parts[0] != "dynamic" or len(parts) != 4:
                raise ValueError
            d, k, m = (int(x) for x in parts[1:])
        except ValueError:
            raise ValueError(f"unknown eagle tree {spec!r}: use 'auto' or 'dynamic-D-K-M' "
                             "(depth D, K candidates expanded per level, M nodes verified), e.g. 'dynamic-5-4-8'") from None
    d, k, m = check_dynamic_tree(d, k, m)
    return {"depth": d, "expand": k, "nodes": m}
