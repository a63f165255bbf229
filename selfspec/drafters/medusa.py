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
from ..core.types import DecodeState, Draft, Drafter, TargetOut
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
    def draft(self, states: list[DecodeState]) -> list[Draft]:
        """Every row's heads in one call, then each row's tree."""
        return [self._draft_from(z, s) for z, s in zip(self._logits(states), states)]

    def _logits(self, states: list[DecodeState]) -> torch.Tensor:
        """(B, depth, V_draft): only the heads the tree uses, on each row's hidden state (its root: the pending token)."""
        depth = self.tree.depth
        hidden = torch.stack([self.hidden[s.row] for s in states])                               # (B, H)
        root = None
        if self.heads.config.token_input:
            root = self.backbone.embed(torch.tensor([s.ids[-1] for s in states], device=hidden.device))[0]  # (B, H)
        h = self.heads.module(hidden, root)[:, :depth]                                           # (B, depth, H)
        return self.project(h.reshape(-1, h.shape[-1])).view(len(states), depth, -1)

    def _draft_from(self, logits: torch.Tensor, state: DecodeState) -> Draft:
        """One row's tree from its heads' logits (depth, V_draft)."""
        cand = row_candidates(logits, tree_width(self.tree), vocab=self.vocab,
                              vocab_size=self.backbone.vocab_size, state=state, draw=False)
        tree = pruned(self.tree, cand.conf, self.threshold, self.gate)
        draft = Draft(tree=tree, tokens=layout(tree, state.ids[-1], cand.tokens), q=cand.q,
                      path_p=layout_path_p(tree, cand.conf))
        return with_lookup(draft, state,
                           self.lookup, vocab_size=self.backbone.vocab_size, corpus=self.corpus)

    def commit(self, states: list[DecodeState], accepted: list[Accepted], outs: list[TargetOut]) -> None:
        for s, a, out in zip(states, accepted, outs):
            self.hidden[s.row] = out.hidden[a.path[-1]]
