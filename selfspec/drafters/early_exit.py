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

A batch: each chain step runs layers[0:E] and the exit head once for every row
still drafting, one token a row, each written after that row's own slots of the target's batched
cache (and of the layer adapter's); a row whose chain lost confidence sits the later
steps out. Every row gets the chain it would get alone.

Exit adapters: a residual MLP is stateless. A decoder-layer adapter attends over earlier
positions, so it keeps its own one-layer KV cache with the same invariant as the target's
(every committed token but the pending one): filled from the prompt's layer-E states at
prefill, extended while drafting, and after each step cut back to the accepted path, plus the
one accepted node it never saw (the last chain draft or a sibling leaf), from the layer-E states
the verification pass captured.
"""

from __future__ import annotations

import torch

from ..core import cache as kv
from ..core.accept import Accepted
from ..core.backbone import Backbone
from ..core.tree import Tree, additive_mask
from ..core.types import DecodeState, Draft, Drafter, Resume, TargetOut
from ..heads import ExitLayerHead, Heads
from .base import check_threshold, draft_head, layout, pruned, row_candidates, tree_width


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
        self.adapter_cache = kv.new_cache()   # a layer adapter's own cache, a row per batch row (``begin``)
        self.drafted: list[int] = []          # per row: chain nodes its last draft ran through layers[0:E] (root included)

    def _adapt(self, h: torch.Tensor, positions: torch.Tensor, rows: list[int],
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Exit adapter on layer-E states (R, n, H) at ``positions`` (R, n); a layer adapter appends its KV
        to rows ``rows`` of its cache. No mask: n == 1 sees the row's whole cache; n > 1 only on an empty
        cache (prefill: causal)."""
        if not self.stateful:
            return self.heads.module(h)
        return self.heads.module(h, position_embeddings=self.backbone.rotary_emb(h, position_ids=positions),
                                 position_ids=positions, attention_mask=mask,
                                 cache=self.adapter_cache.rows(rows))

    def _positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.backbone.device)[None]

    @torch.no_grad()
    def begin(self, states: list[DecodeState], prefills: list[TargetOut]) -> None:
        """A layer adapter's per-row caches are the rows of one batched cache (one call per chain step for all rows)."""
        self.drafted = [0] * len(states)
        if not self.stateful:
            return
        self.adapter_cache = kv.new_cache(len(states))
        for b, out in enumerate(prefills):
            self._adapt(out.captured[0], self._positions(0, out.captured[0].shape[1]), rows=[b])

    @torch.no_grad()
    def commit(self, states: list[DecodeState], accepted: list[Accepted], outs: list[TargetOut]) -> None:
        for s, a, out in zip(states, accepted, outs):
            drafted, self.drafted[s.row] = self.drafted[s.row], 0   # a plain step of the back-off runs no adapter
            if not self.stateful:
                continue
            past = s.past_len - len(a.path)     # the cache length before this step
            # Drafting ran the adapter on chain nodes 0..m-1; the path is 0, 1, .., j (+ a sibling leaf).
            seen = sum(1 for node in a.path if node < drafted)
            self.adapter_cache.row(s.row).truncate(past + seen)
            missing = list(a.path[seen:])            # at most one node: chain node k or a leaf
            if missing:
                self._adapt(out.captured[0][:, missing], self._positions(past + seen, len(missing)), rows=[s.row])

    @torch.no_grad()
    def draft(self, states: list[DecodeState]) -> list[Draft]:
        """Every row's chain, one call of layers[0:E] (and the exit head) per chain step for all rows
        still drafting; each row writes its KV after its own slots of the target's batched cache."""
        bb, E, k, R = self.backbone, self.exit_layer, self.tree.depth, len(states)
        target = states[0].cache.cache                       # the target's KVCache; each state holds a row of it
        rows = [s.cache.index for s in states]
        past = torch.tensor([s.past_len for s in states], device=bb.device)
        tok = torch.tensor([s.ids[-1] for s in states], device=bb.device)
        hiddens, cands = [[] for _ in range(R)], [[] for _ in range(R)]
        chain_conf = [1.0] * R   # each row's chain's path probability so far (float64, as the host reads it)
        active = list(range(R))
        for j in range(k):
            a = torch.tensor(active, device=bb.device)
            pos = (past[a] + j)[:, None]                                                      # (A, 1)
            mask = None
            if len(active) > 1:   # rows of different lengths: each query sees its own row's slots and itself
                T = max(states[b].past_len for b in active) + j + 1   # (known on the host: no read)
                mask = additive_mask(torch.arange(T, device=bb.device)[None, None] <= pos[:, :, None], bb.dtype)
            # One token a row through layers[0:E]; their KV for those layers lands in the shared cache.
            h = bb.run_layers(bb.embed_tokens(tok[a][:, None]), start=0, end=E, position_ids=pos, attention_mask=mask,
                              cache=target.rows([rows[b] for b in active]))                      # (A, 1, H)
            adapted = self._adapt(h, pos, rows=[states[b].row for b in active], mask=mask)
            z = self.project(bb.final_norm(adapted[:, 0]))                                     # (A, V_draft)
            cand = row_candidates(z, self.width, vocab=self.vocab, vocab_size=bb.vocab_size, state=states[0],
                                  draw=True)
            still = []
            # Under a threshold, every row's confidences in one read (on a GPU, one synchronisation): the chain
            # stops on them, and the tree is cut with them (``_draft_from``), with nothing more to read.
            confs = cand.conf.tolist() if self.threshold > 0 else [[1.0]] * len(active)   # (A, width)
            for i, b in enumerate(active):
                hiddens[b].append(h[i:i + 1])
                cands[b].append((cand.tokens[i:i + 1], None if cand.q is None else cand.q[i:i + 1], confs[i]))
                chain_conf[b] *= confs[i][0]                             # same product tree.prune takes
                if chain_conf[b] >= self.threshold:
                    still.append(b)   # else the next chain node is too doubtful to pay for another half step
            tok = tok.index_copy(0, a, cand.tokens[:, 0])  # chains continue with the best (greedy) or first-drawn candidate
            active = still
            if not active:
                break
        for s, h in zip(states, hiddens):
            self.drafted[s.row] = len(h)
        return [self._draft_from(s, h, c) for s, h, c in zip(states, hiddens, cands)]

    def _draft_from(self, state: DecodeState, hiddens: list[torch.Tensor], cands: list) -> Draft:
        """One row's draft from the chain it ran: layer-E states and candidates per depth drafted."""
        k = self.tree.depth
        rows = [c[0] for c in cands]
        pad = k - len(rows)  # depths never drafted: zero confidence, pruned below
        tokens_rows = torch.cat(rows + [rows[0].new_zeros(pad, self.width)])
        # (the host's confidences per depth drafted; without a threshold nothing is cut)
        tree = pruned(self.tree, [c[2] for c in cands] + [[0.0] * self.width] * pad, self.threshold)
        # The drafted chain nodes lead the tree; the cache holds layers[0:E] for exactly these.
        assert tree.paths[: len(hiddens) - 1] == self.tree.paths[: len(hiddens) - 1] and tree.size >= len(hiddens)
        tokens = layout(tree, state.ids[-1], tokens_rows)
        q = torch.cat([c[1] for c in cands]) if state.params.do_sample else None
        return Draft(tree=tree, tokens=tokens, q=q, resume=Resume(layer=self.exit_layer, hidden=torch.cat(hiddens, dim=1)))
