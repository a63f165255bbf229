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
* finally, greedy keeps the ``nodes`` best nodes of all drafted (path probabilities; a child never
  outscores its parent, so the kept set is a tree), and cuts those below ``threshold``; drafting
  stops early at a level whose best path is already below it (on a CPU each level costs a head call).

Sampling stays exact (``verify.rejection_accept_tree``): a node's children are drawn without
replacement from that node's own distribution, in draw order, and whether a child is kept or
expanded must not depend on which token was drawn. So when sampling, a child of rank r is scored
with its parent's r-th largest probability instead of its own, and the tree keeps the
``expand`` best of each level (a beam, ``expand`` x ``depth`` nodes): every kept set is then
decided by the parents' distributions alone. ``Draft.q_index`` names each node's row.

With ``lookup`` = k > 0 a step also grafts up to k tokens copied from the context, or where it
has no match from the ``corpus`` (``lookup.with_lookup``; point-mass q rows when sampling).
"""

from __future__ import annotations

import copy
import math

import torch

from .. import cache as kv
from ..backbone import Backbone
from ..corpus import Corpus
from ..heads import Heads
from ..projection import Projection
from ..sampling import pick_candidates, probs_from_logits
from ..tree import additive_mask, subtree
from ..verify import Accepted
from .base import DecodeState, Draft, Drafter, TargetOut, check_lookup, check_threshold, draft_dtype, full_vocab
from .lookup import with_lookup


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


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, backbone: Backbone, heads: Heads, *, depth: int = 5, expand: int = 4, nodes: int = 8,
                 threshold: float = 0.0, lookup: int = 0, corpus: Corpus | None = None,
                 dtype: torch.dtype | None = None):
        aux = tuple(heads.config.aux_layers)
        if len(aux) == 0 or not all(0 < a <= backbone.num_layers for a in aux):
            raise ValueError(f"eagle aux layers {aux} must lie between 1 and {backbone.num_layers}")
        self.backbone = backbone
        self.heads = heads
        # dtype: what the head drafts in (default: ``draft_dtype``); a copy when it differs from the loaded head's.
        self.dtype = dtype or draft_dtype(backbone.device, backbone.dtype)
        loaded = next(heads.module.parameters()).dtype
        self.head = heads.module if self.dtype == loaded else copy.deepcopy(heads.module).to(self.dtype)
        self.depth, self.expand, self.nodes = check_dynamic_tree(depth, expand, nodes)
        self.threshold = check_threshold(threshold)
        self.log_threshold = math.log(self.threshold) if self.threshold > 0 else -math.inf
        self.lookup = check_lookup(lookup)
        self.corpus = corpus                           # where the lookup finds no context match (corpus.py)
        self.vocab = heads.draft_vocab                 # (V_draft,) draft id -> token id, or None
        self.capture_layers = aux
        # The head's LM head in the layout measured fastest for each row count (few-row products are slow on CPU BLAS).
        self.project = Projection(self.head.lm_head.weight)
        self.cache = kv.new_cache()
        self.committed = 0                             # head cache slots that hold committed tokens
        self.root_state: torch.Tensor | None = None    # (1, 1, H) output of the last committed slot

    @property
    def max_nodes(self) -> int:
        return 1 + self.nodes + self.lookup

    # ------------------------------------------------------------------ the head's own cache
    def _run(self, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Slots for ``tokens`` (n,) at ``positions`` (n,) reading ``feature`` (1, n, H) -> (1, n, H) states."""
        bb = self.backbone
        pos = positions[None]
        return self.head(feature, bb.embed(tokens).to(self.dtype),
                         position_embeddings=bb.rotary_emb(feature, position_ids=pos), cache=self.cache,
                         attention_mask=mask)

    def _fill(self, captured: tuple[torch.Tensor, ...], nodes, tokens: torch.Tensor, start: int) -> None:
        """Committed slots start.. from the target's features at ``nodes`` of a pass; tokens: the next token of each."""
        feature = self.head.fuse(torch.cat([c[:, nodes] for c in captured], dim=-1).to(self.dtype))
        states = self._run(feature, tokens, torch.arange(start, start + tokens.shape[0], device=tokens.device))
        self.root_state = states[:, -1:]
        self.committed = start + tokens.shape[0]

    @torch.no_grad()
    def begin(self, state: DecodeState, prefill: TargetOut) -> None:
        self.cache = kv.new_cache()
        P = state.past_len                       # prompt positions 0..P-1; ids[P] is pending
        ids = torch.tensor(state.ids[1:P + 1], device=self.backbone.device)
        self._fill(prefill.captured, slice(None), ids, 0)

    @torch.no_grad()
    def commit(self, state: DecodeState, accepted: Accepted, out: TargetOut) -> None:
        start = self.committed
        kv.truncate(self.cache, start)           # drop this step's speculative slots
        nxt = torch.tensor(state.ids[start + 1: state.past_len + 1], device=self.backbone.device)
        self._fill(out.captured, list(accepted.path), nxt, start)

    # ------------------------------------------------------------------ drafting
    def _candidates(self, logits: torch.Tensor, state: DecodeState):
        """(r, V_draft) logits -> (r, expand) draft ids, their scores (log-prob used for ranking), q (r, V_draft) or None."""
        k = self.expand
        if not state.params.do_sample:
            logp = logits.float().log_softmax(-1)
            score, cand = logp.topk(k, dim=-1)
            return cand, score, None
        q = probs_from_logits(logits, state.params)
        cand = pick_candidates(q, k, params=state.params, generator=state.generator)
        # Rank r is scored by the row's r-th largest probability, never by the token drawn.
        score = q.topk(k, dim=-1).values.clamp(min=1e-30).log()
        return cand, score, q

    @torch.no_grad()
    def draft(self, state: DecodeState) -> Draft:
        dev, P, k = self.backbone.device, state.past_len, self.expand
        sampling = state.params.do_sample
        # The pool of drafted nodes, node 0 = the root; children appended level by level.
        cand, score, q = self._candidates(self._logits(self.root_state[0]), state)        # (1, k)
        tokens = [torch.tensor([state.ids[-1]], device=dev), self._to_ids(cand[0])]
        parents = [torch.tensor([-1], device=dev), torch.zeros(k, dtype=torch.long, device=dev)]
        ranks = [torch.zeros(1, dtype=torch.long, device=dev), torch.arange(k, device=dev)]
        scores = [torch.zeros(1, device=dev), score[0]]
        qrows = [torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(k, dtype=torch.long, device=dev)]
        q_list = [q] if sampling else []
        level = torch.arange(1, k + 1, device=dev)            # pool ids of the newest level
        state_of = {0: self.root_state[0]}                    # pool id -> its output state (run nodes)
        slot_of = torch.full((1 + k,), -1, dtype=torch.long, device=dev)  # pool id -> speculative slot
        frontiers = []
        n = 1 + k
        for d in range(1, self.depth):
            lvl_scores = torch.cat(scores)[level]
            best = torch.sort(-lvl_scores, stable=True).indices[:k]
            top, top_scores = level[best], lvl_scores[best]                     # the level's best k
            if self.threshold > 0 and float(top_scores[0]) < self.log_threshold:
                break   # every deeper path scores lower still: the threshold would cut it, so draft no further
            frontiers.append(top)
            all_par = torch.cat(parents)
            # Each runs in slot P + d - 1, reading its parent's output state.
            feature = torch.stack([state_of[int(p)] for p in all_par[top].tolist()], dim=1)   # (1, k, H)
            mask = self._tree_mask(top, all_par, slot_of, d)
            slot_of = torch.cat([slot_of, torch.full((n - slot_of.shape[0],), -1, dtype=torch.long, device=dev)])
            slot_of[top] = self.committed + (d - 1) * k + torch.arange(top.shape[0], device=dev)
            states = self._run(feature, torch.cat(tokens)[top], torch.full((top.shape[0],), P + d - 1, device=dev), mask)
            for j, node in enumerate(top.tolist()):
                state_of[node] = states[:, j]
            cand, score, q = self._candidates(self._logits(states[0]), state)      # (k, k)
            m = top.shape[0] * k
            tokens.append(self._to_ids(cand.reshape(-1)))
            parents.append(top.repeat_interleave(k))
            ranks.append(torch.arange(k, device=dev).repeat(top.shape[0]))
            scores.append((top_scores[:, None] + score).reshape(-1))
            if sampling:
                qrows.append(len(q_list) + torch.arange(top.shape[0], device=dev).repeat_interleave(k))
                q_list.append(q)
            else:
                qrows.append(torch.zeros(m, dtype=torch.long, device=dev))
            level = torch.arange(n, n + m, device=dev)
            n += m
        tokens, parents, ranks = torch.cat(tokens), torch.cat(parents), torch.cat(ranks)
        scores, qrows = torch.cat(scores), torch.cat(qrows)

        if sampling:   # a beam: the best k of every level, decided by the parents' distributions alone
            last = level[torch.sort(-scores[level], stable=True).indices[:k]]
            keep = torch.cat(frontiers + [last])
        else:          # EAGLE-2: the best ``nodes`` of all drafted
            order = torch.sort(-scores[1:], stable=True).indices + 1
            keep = order[: self.nodes]
        if self.threshold > 0:
            keep = keep[scores[keep].exp() >= self.threshold]
            keep = keep[self._closed(keep, parents)]
        keep, _ = torch.sort(keep)                     # pool order: parents before children
        nodes = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), keep])
        tree = subtree(parents, ranks, nodes, max_depth=self.depth)
        q_full, q_index = None, None
        if sampling:
            q_full = full_vocab(torch.cat(q_list), self.vocab, self.backbone.vocab_size)
            q_index = qrows[nodes]
        draft = Draft(tree=tree, tokens=tokens[nodes], q=q_full, q_index=q_index, path_p=scores[nodes].exp())
        return with_lookup(draft, state, self.lookup, vocab_size=self.backbone.vocab_size, corpus=self.corpus)

    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        """(r, H) output states -> (r, V_draft) draft logits."""
        return self.project(self.head.norm(states))

    def _tree_mask(self, top: torch.Tensor, parents: torch.Tensor, slot_of: torch.Tensor, d: int) -> torch.Tensor:
        """(1, 1, k, T) additive mask: committed slots, each node's drafted ancestors' slots and its own."""
        k = top.shape[0]
        spec = (d - 1) * self.expand                    # speculative slots already in the cache
        T = self.committed + spec + k
        visible = torch.zeros(k, T, dtype=torch.bool, device=top.device)
        visible[:, : self.committed] = True
        visible[torch.arange(k), self.committed + spec + torch.arange(k)] = True
        up = parents[top]
        for _ in range(d - 1):                          # ancestors at levels d-1 .. 1
            s = slot_of[up.clamp(min=0)]
            ok = (up > 0) & (s >= 0)
            visible[torch.arange(k, device=top.device)[ok], s[ok]] = True
            up = torch.where(up > 0, parents[up.clamp(min=0)], up)
        return additive_mask(visible, self.root_state.dtype)

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

