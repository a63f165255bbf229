"""Early-exit drafter: the target's first E decoder layers + a trained exit head draft a chain.

Drafting runs layers[0:E] one token at a time on the pending token and the drafts, writing
their KV (layers < E) straight into the target's cache. Those entries are exactly what a full
pass would compute (same tokens, same causal context), so the verifier resumes at layer E from
the saved hidden states and runs layers[0:E] only for nodes the draft never ran (the last draft
and any sibling leaves). This is LayerSkip's reuse of the draft's KV in verification.

Tree: a chain of k (nodes 1..k first, so node order matches the order the cache was written
in), optionally with width - 1 alternative leaves per depth from the same exit distribution.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..backbone import Backbone
from ..heads import Heads
from ..tree import Tree
from .base import DecodeState, Draft, Drafter, Resume, layout, lm_head_rows, row_candidates, tree_width


class EarlyExitDrafter(Drafter):
    name = "early-exit"

    def __init__(self, backbone: Backbone, heads: Heads, tree: Tree):
        exit_layer = heads.config.exit_layer
        if exit_layer is None or not 0 < exit_layer < backbone.num_layers:
            raise ValueError(f"exit layer {exit_layer} must be between 1 and {backbone.num_layers - 1}")
        k = tree.depth
        spine = tuple((0,) * d for d in range(1, k + 1))
        if tree.paths[:k] != spine or any(p[:-1] != (0,) * (len(p) - 1) for p in tree.paths):
            raise ValueError("early exit drafts a chain: its tree must list the chain (0,), (0, 0), ... first, "
                             "and may add sibling leaves under chain nodes only (e.g. tree='chain-4-w2')")
        self.backbone = backbone
        self.heads = heads
        self.tree = tree
        self.exit_layer = exit_layer
        self.width = tree_width(tree)
        self.vocab = heads.draft_vocab
        self.weight = lm_head_rows(backbone, self.vocab)  # (V_draft, H)

    @torch.no_grad()
    def draft(self, state: DecodeState) -> Draft:
        bb, E, k = self.backbone, self.exit_layer, self.tree.depth
        past, tok = state.past_len, state.ids[-1]
        hiddens, rows, qs = [], [], []
        for j in range(k):
            # One token through layers[0:E]; its KV for those layers lands in the shared cache.
            # No mask: the query is the newest position and may see every cached one.
            h = bb.run_layers(bb.embed(torch.tensor([tok], device=bb.device)), start=0, end=E,
                              position_ids=torch.tensor([[past + j]], device=bb.device),
                              attention_mask=None, cache=state.cache)          # (1, 1, H)
            hiddens.append(h)
            z = F.linear(bb.final_norm(self.heads.module(h[0])), self.weight)  # (1, V_draft)
            cand = row_candidates(z, self.width, vocab=self.vocab, vocab_size=bb.vocab_size, state=state)
            rows.append(cand.tokens)
            qs.append(cand.q)
            tok = int(cand.tokens[0, 0])  # the chain continues with the best (greedy) or first-drawn candidate
        tokens = layout(self.tree, state.ids[-1], torch.cat(rows))
        q = torch.cat(qs) if state.params.do_sample else None
        return Draft(tree=self.tree, tokens=tokens, q=q, resume=Resume(layer=E, hidden=torch.cat(hiddens, dim=1)))
