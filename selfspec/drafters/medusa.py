"""Medusa drafter: K heads on the target's last hidden state propose a sparse candidate tree.

No extra forward pass: the hidden state that produced the pending token comes out of the
previous verification (or prefill), and head d's top candidates fill depth d of the tree.
With ``threshold`` > 0 the tree is cut each step to the nodes the heads give at least that path
probability; with ``gate`` > 0 a step whose tree the heads expect to get fewer than ``gate``
tokens accepted proposes nothing and costs one plain step (``tree.prune``). When sampling, head d's
likeliest tokens (after the sampling processors) fill depth d too, undrawn: each is a certain token,
accepted with the chance the target itself gives it (``accept.point_accept_tree``), so sampling stays
exact whatever is cut. With ``lookup`` = k > 0,
steps also graft up to k tokens copied from the context onto the tree (``lookup.py``).
"""

from __future__ import annotations

import torch

from ..core.accept import Accepted
from ..core.backbone import Backbone
from ..core.tree import Tree
from ..core.types import DecodeState, Draft, Drafter, Drafts, HostDraft, TargetOut
from ..corpus import Corpus
from ..heads import Heads
from .base import (
    check_gate,
    check_lookup,
    check_threshold,
    draft_head,
    layout,
    layout_path_p,
    pruned,
    row_candidates,
    tree_width,
)
from .lookup import with_lookup


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, backbone: Backbone, heads: Heads, tree: Tree, threshold: float = 0.0, gate: float = 0.0,
                 lookup: int = 0, corpus: Corpus | None = None):
        k = heads.config.num_heads
        if tree.depth > k:
            raise ValueError(f"tree depth {tree.depth} exceeds the {k} Medusa heads: use a tree of depth <= {k}")
        self.backbone = backbone
        self.heads = heads
        self.tree = tree
        self.threshold = check_threshold(threshold)
        self.gate = check_gate(gate)
        self.lookup = check_lookup(lookup)
        self.corpus = corpus                             # where the lookup finds no context match (corpus.py)
        self.vocab = heads.draft_vocab
        self.project = draft_head(backbone, self.vocab)  # (.., H) -> (.., V_draft)
        self.hidden: list[torch.Tensor] = []             # per row: the (H,) state that produced its pending token

    def begin(self, states: list[DecodeState], prefills: list[TargetOut]) -> None:
        self.hidden = [out.hidden[-1] for out in prefills]

    @torch.no_grad()
    def draft(self, states: list[DecodeState]) -> Drafts:
        """Every row's heads in one call, and every row's candidates, node tokens and path probabilities as
        batched tensor ops; a row's tree is cut on its own only under a threshold or gate (``pruned``)."""
        B, tree = len(states), self.tree
        roots = torch.tensor([s.ids[-1] for s in states], device=self.backbone.device)            # (B,)
        logits = self._logits(states, roots)                                                     # (B, depth, V_draft)
        # The decode's sampling params, which every row shares (and no draw: the generator is not read).
        cand = row_candidates(logits.flatten(0, 1), tree_width(tree), vocab=self.vocab,
                              vocab_size=self.backbone.vocab_size, state=states[0], draw=False)
        table, conf = cand.tokens.view(B, tree.depth, -1), cand.conf.view(B, tree.depth, -1)
        tokens, path_p = layout(tree, roots, table), layout_path_p(tree, conf)                   # (B, n) each
        if self.threshold > 0 or self.gate > 0:
            drafts = self._cut(tree, tokens, path_p, conf)
        else:
            drafts = [Draft(tree=tree, tokens=tokens[b], path_p=path_p[b]) for b in range(B)]
        whole = all(d.tree is tree for d in drafts)   # (every row's tokens laid out flat already)
        drafts = Drafts(drafts, tokens=tokens.reshape(-1)) if whole else Drafts(drafts)
        return with_lookup(drafts, states, self.lookup, vocab_size=self.backbone.vocab_size, corpus=self.corpus)

    def _cut(self, tree: Tree, tokens: torch.Tensor, path_p: torch.Tensor, conf: torch.Tensor) -> list[Draft]:
        """Every row's tree cut on the host (``pruned``) from ONE read of every row's node tokens, path
        probabilities and confidences (tokens, path_p: (B, n); conf: (B, depth, width)). Each draft carries
        what the host read of it (``Draft.host``), so a lookup graft and width fitting read nothing more.
        A cut tree keeps its nodes in the whole tree's order, so its tokens and path probabilities are the
        whole tree's at the kept nodes."""
        B, n, (depth, width) = tokens.shape[0], tree.size, conf.shape[1:]
        flat = torch.cat([tokens.double(), path_p.double(), conf.reshape(B, -1).double()], 1).tolist()
        place = {p: i for i, p in enumerate(tree.paths, start=1)}   # path -> node id in the whole tree
        drafts = []
        for b, row in enumerate(flat):
            held = row[2 * n:]
            cut = pruned(tree, [held[d * width: (d + 1) * width] for d in range(depth)], self.threshold, self.gate)
            keep = list(range(n)) if cut is tree else [0] + [place[p] for p in cut.paths]
            if cut is tree:
                draft = Draft(tree=tree, tokens=tokens[b], path_p=path_p[b])
            else:
                at = torch.tensor(keep, device=tokens.device)
                draft = Draft(tree=cut, tokens=tokens[b, at], path_p=path_p[b, at])
            draft.__dict__["host"] = HostDraft([int(row[i]) for i in keep], *cut.lists,
                                               path_p=[row[n + i] for i in keep])
            drafts.append(draft)
        return drafts

    def _logits(self, states: list[DecodeState], roots: torch.Tensor) -> torch.Tensor:
        """(B, depth, V_draft): only the heads the tree uses, on each row's hidden state (its root, the
        pending token ``roots[b]``)."""
        depth = self.tree.depth
        hidden = torch.stack([self.hidden[s.row] for s in states])                               # (B, H)
        root = self.backbone.embed(roots)[0] if self.heads.config.token_input else None           # (B, H)
        h = self.heads.module(hidden, root)[:, :depth]                                           # (B, depth, H)
        return self.project(h.reshape(-1, h.shape[-1])).view(len(states), depth, -1)

    def commit(self, states: list[DecodeState], accepted: list[Accepted], outs: list[TargetOut]) -> None:
        for s, a, out in zip(states, accepted, outs):
            self.hidden[s.row] = out.hidden[a.path[-1]]
