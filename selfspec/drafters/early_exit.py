"""Early-exit drafter: the target's first E decoder layers + a trained exit head draft a chain.

Drafting runs layers[0:E] one token at a time on the pending token and the drafts, writing
their KV (layers < E) straight into the target's cache. Those entries are exactly what a full
pass would compute (same tokens, same causal context), so the verifier resumes at layer E from
the saved hidden states and runs layers[0:E] only for nodes the draft never ran (the last draft
and any sibling leaves). This is LayerSkip's reuse of the draft's KV in verification.

Tree: a chain of k (nodes 1..k first, so node order matches the order the cache was written
in), optionally with width - 1 alternative leaves per depth from the same exit distribution.

Confidence: with ``threshold`` > 0 the chain stops as soon as its path probability under the
exit head falls below it (and siblings are cut the same way, ``tree.prune``). Each chain node
costs half a decode step to draft, so stopping early is where this drafter saves most. A step
whose very first draft is doubtful proposes nothing: the verifier then runs only layers[E:] on
the pending token, whose layers[0:E] the draft already ran, so it costs one plain step plus
the exit head, and never the half step a rejected draft would waste in verification.

Exit adapters: a residual MLP is stateless. A decoder-layer adapter attends over earlier
positions, so it keeps its own one-layer KV cache with the same invariant as the target's
(every committed token but the pending one): filled from the prompt's layer-E states at
prefill, extended while drafting, and after each step cut back to the accepted path, plus the
one accepted node it never saw (the last chain draft or a sibling leaf), from the layer-E states
the verification pass captured.
"""

from __future__ import annotations

import torch

from ..backbone import Backbone
from .. import cache as kv
from ..heads import ExitLayerHead, Heads
from ..tree import Tree
from ..verify import Accepted
from .base import (DecodeState, Draft, Drafter, Resume, TargetOut, check_threshold, draft_head, layout, pruned,
                   row_candidates, tree_width)


class EarlyExitDrafter(Drafter):
    name = "early-exit"

    def __init__(self, backbone: Backbone, heads: Heads, tree: Tree, threshold: float = 0.0):
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
        self.threshold = check_threshold(threshold)
        self.exit_layer = exit_layer
        self.width = tree_width(tree)
        self.vocab = heads.draft_vocab
        self.project = draft_head(backbone, self.vocab)  # (.., H) -> (.., V_draft)
        self.stateful = isinstance(heads.module, ExitLayerHead)
        self.capture_layers = (exit_layer,) if self.stateful else ()
        self.adapter_cache = kv.new_cache()
        self.drafted = 0  # chain nodes the last draft ran through layers[0:E] (root included)

    def _adapt(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """Exit adapter on layer-E states (1, n, H) at positions start.. ; a layer adapter appends its KV."""
        if not self.stateful:
            return self.heads.module(h)
        pos = torch.arange(start, start + h.shape[1], device=h.device)[None]
        # No mask: n == 1 sees its whole cache; n > 1 only at prefill, on an empty cache (causal).
        return self.heads.module(h, position_embeddings=self.backbone.rotary_emb(h, position_ids=pos),
                                 position_ids=pos, cache=self.adapter_cache)

    @torch.no_grad()
    def begin(self, state: DecodeState, prefill: TargetOut) -> None:
        if self.stateful:
            self.adapter_cache = kv.new_cache()
            self._adapt(prefill.captured[0], 0)

    @torch.no_grad()
    def commit(self, state: DecodeState, accepted: Accepted, out: TargetOut) -> None:
        if not self.stateful:
            return
        past = state.past_len - len(accepted.path)     # the cache length before this step
        # Drafting ran the adapter on chain nodes 0..m-1; the path is 0, 1, .., j (+ a sibling leaf).
        seen = sum(1 for node in accepted.path if node < self.drafted)
        kv.truncate(self.adapter_cache, past + seen)
        missing = list(accepted.path[seen:])            # at most one node: chain node k or a leaf
        if missing:
            self._adapt(out.captured[0][:, missing], past + seen)

    @torch.no_grad()
    def draft(self, state: DecodeState) -> Draft:
        bb, E, k = self.backbone, self.exit_layer, self.tree.depth
        past, tok = state.past_len, state.ids[-1]
        hiddens, rows, qs, confs = [], [], [], []
        chain_conf = 1.0
        for j in range(k):
            # One token through layers[0:E]; its KV for those layers lands in the shared cache.
            # No mask: the query is the newest position and may see every cached one.
            h = bb.run_layers(bb.embed(torch.tensor([tok], device=bb.device)), start=0, end=E,
                              position_ids=torch.tensor([[past + j]], device=bb.device),
                              attention_mask=None, cache=state.cache)          # (1, 1, H)
            hiddens.append(h)
            z = self.project(bb.final_norm(self._adapt(h, past + j)[0]))  # (1, V_draft)
            cand = row_candidates(z, self.width, vocab=self.vocab, vocab_size=bb.vocab_size, state=state)
            rows.append(cand.tokens)
            qs.append(cand.q)
            confs.append(cand.conf)
            chain_conf *= float(cand.conf[0, 0])                  # same product tree.prune takes
            if chain_conf < self.threshold:
                break      # the next chain node is too doubtful to pay for another half step
            tok = int(cand.tokens[0, 0])  # the chain continues with the best (greedy) or first-drawn candidate
        pad = k - len(rows)  # depths never drafted: zero confidence, pruned below
        tokens_rows = torch.cat(rows + [rows[0].new_zeros(pad, self.width)])
        tree = pruned(self.tree, torch.cat(confs + [confs[0].new_zeros(pad, self.width)]), self.threshold)
        # The drafted chain nodes lead the tree; the cache holds layers[0:E] for exactly these.
        assert tree.paths[: len(hiddens) - 1] == self.tree.paths[: len(hiddens) - 1] and tree.size >= len(hiddens)
        tokens = layout(tree, state.ids[-1], tokens_rows)
        self.drafted = len(hiddens)
        q = torch.cat(qs) if state.params.do_sample else None
        return Draft(tree=tree, tokens=tokens, q=q, resume=Resume(layer=E, hidden=torch.cat(hiddens, dim=1)))
