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
from ..core.types import DecodeState, Draft, Drafter, Drafts, TargetOut
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
        drafts = []
        # Under a threshold or gate, every row's confidences in one read (each row's tree is cut on the host).
        host = conf.tolist() if self.threshold > 0 or self.gate > 0 else [None] * B
        for b in range(B):
            cut = pruned(tree, host[b], self.threshold, self.gate)
            drafts.append(Draft(tree=tree, tokens=tokens[b], path_p=path_p[b]) if cut is tree else
                          Draft(tree=cut, tokens=layout(cut, states[b].ids[-1], table[b]),
                                path_p=layout_path_p(cut, conf[b])))
        whole = all(d.tree is tree for d in drafts)   # (every row's tokens laid out flat already)
        drafts = Drafts(drafts, tokens=tokens.reshape(-1)) if whole else Drafts(drafts)
        return with_lookup(drafts, states, self.lookup, vocab_size=self.backbone.vocab_size, corpus=self.corpus)

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
