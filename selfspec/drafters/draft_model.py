"""Two-model baseline: a separate small causal LM (same tokenizer) drafts a chain of k tokens.

The draft model keeps its own KV cache (a ``cache.KVCache``), run layer by layer through a
``Backbone`` as the target is, so it must be of a supported family. It has seen a prefix of the
committed tokens; each step it first catches up on the tokens it has not seen (the pending
token, plus the last draft when the whole chain was accepted), then drafts k - 1 more.

A batch: the rows' draft caches are the rows of one batched cache,
each at its own length; the catch-up of every row (ragged: padded, the padding cut off after) and
each chain step of every row still drafting run in one draft forward. Every row gets the chain it
would get alone.

A draft distilled by ``selfspec train-draft`` names the frequent-token subset it was trained on
(``config.selfspec_draft_vocab``); the drafter then scores only those rows of the draft's LM head
(its decoder's last hidden state times the subset's rows) instead of the full vocabulary, which
on a small draft costs more than its layers. Proposals are restricted to that subset; the verifier
is unchanged, so the output is too.

Confidence: with ``threshold`` > 0 the chain stops as soon as its path probability under the draft
falls below it (the doubtful node is dropped too, as ``tree.prune`` drops it), so a draft forward
is not spent on tokens the target will likely reject; a step whose first draft is doubtful
proposes nothing. On a CPU, where a big draft's forward is a third of the target's, this is
where the two-model drafter wins or loses.

Precision: the draft runs in its own dtype unless ``dtype=`` asks for another (then on a copy). Drafts only propose, so this never changes the output.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch.nn import functional as F

from ..core import cache as kv
from ..core.accept import Accepted
from ..core.backbone import Backbone
from ..core.tree import Tree, additive_mask
from ..core.types import DecodeState, Draft, Drafter, TargetOut
from .base import check_threshold, layout, pruned, row_candidates


def truncated_copy(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A standalone causal LM made of the target's embeddings, first ``num_layers`` decoder layers,
    final norm and LM head: the usual starting point for a distilled two-model draft. The target
    itself is untouched (a copy of its config gets the smaller depth)."""
    from transformers import AutoModelForCausalLM

    n = model.config.num_hidden_layers
    if not 0 < num_layers < n:
        raise ValueError(f"a draft needs between 1 and {n - 1} layers (got {num_layers})")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    p = model.get_output_embeddings().weight
    draft = AutoModelForCausalLM.from_config(config, dtype=p.dtype, attn_implementation="sdpa")
    # strict=False: the target's state dict also holds the layers the draft does not have.
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    if missing:
        raise ValueError(f"could not copy {len(missing)} tensors into the draft (e.g. {missing[0]})")
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.to(p.device).eval()


class DraftModelDrafter(Drafter):
    name = "draft-model"

    def __init__(self, draft_model: torch.nn.Module, tree: Tree, *, vocab_size: int, threshold: float = 0.0,
                 dtype: torch.dtype | None = None):
        if not tree.is_chain:
            raise ValueError("the draft-model drafter drafts a chain: use tree='chain-K'")
        draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
        if draft_vocab < vocab_size:
            raise ValueError(f"draft model vocabulary ({draft_vocab}) is smaller than the target's ({vocab_size}): "
                             "the draft must share the target's tokenizer")
        w = draft_model.get_output_embeddings().weight
        self.dtype = dtype or w.dtype
        # A copy in the drafting dtype when it differs: the caller's model (which transformers'
        # assisted generation may also be using, as in the bench) stays as it was.
        self.model = draft_model if self.dtype == w.dtype else copy.deepcopy(draft_model).to(self.dtype)
        self.backbone = Backbone(self.model)
        self.tree = tree
        self.vocab_size = vocab_size
        self.threshold = check_threshold(threshold)
        self.cache = kv.new_cache()   # the draft's KV cache, a row per batch row (``begin``)
        self.seen: list[int] = []     # per row: tokens of its ids in its row of ``cache``
        self.fed: list[int] = []      # per row: drafted tokens fed to the cache in the last step
        subset = getattr(draft_model.config, "selfspec_draft_vocab", None)
        w = self.model.get_output_embeddings().weight
        self.vocab = None if subset is None else torch.as_tensor(subset, dtype=torch.long, device=w.device)
        # Scores only the target's vocabulary (or the draft's subset of it).
        b = getattr(self.model.get_output_embeddings(), "bias", None)
        rows = slice(0, vocab_size) if self.vocab is None else self.vocab
        self.project = functools.partial(F.linear, weight=w[rows], bias=None if b is None else b[rows])

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def begin(self, states: list[DecodeState], prefills: list[TargetOut]) -> None:
        """The rows' draft caches are the rows of one batched cache (one draft forward per step for all rows)."""
        self.cache, self.seen, self.fed = kv.new_cache(len(states)), [0] * len(states), [0] * len(states)

    def _forward(self, rows: list[int], feeds: list[list[int]] | torch.Tensor) -> torch.Tensor:
        """Feed each row's ids after its seen prefix, all rows in one call -> (R, V) logits for each row's
        next token (V_draft with a draft vocabulary). feeds: per row a list of ids, or (R, 1) ids on the
        device (a chain step's drawn tokens: not read back). Rows padded to the longest feed, each query
        masked to its own row's slots (causal); the padding slots are cut off after."""
        bb, dev, R = self.backbone, self.device, len(rows)
        n = [1] * R if isinstance(feeds, torch.Tensor) else [len(f) for f in feeds]
        N = max(n)
        past = torch.tensor([self.seen[b] for b in rows], device=dev)
        x = feeds.to(dev) if isinstance(feeds, torch.Tensor) else \
            torch.tensor([f + [0] * (N - len(f)) for f in feeds], device=dev)
        pos = past[:, None] + torch.arange(N, device=dev)
        mask = None   # one row: one query sees its whole cache, and n queries on an empty cache are plain causal
        if R > 1 or (N > 1 and self.seen[rows[0]] > 0):
            visible = torch.arange(max(self.seen[b] for b in rows) + N, device=dev)[None, None, :] <= pos[:, :, None]
            mask = additive_mask(visible, bb.dtype)                                      # (R, 1, N, T)
        h = bb.run_layers(bb.embed_tokens(x), start=0, end=bb.num_layers, position_ids=pos, attention_mask=mask,
                          cache=self.cache.rows(rows))
        for b, m in zip(rows, n):
            self.seen[b] += m
            self.cache.row(b).truncate(self.seen[b])
        last = h[torch.arange(R, device=dev), torch.tensor(n, device=dev) - 1]             # (R, H)
        return self.project(bb.final_norm(last)).float()

    @torch.no_grad()
    def draft(self, states: list[DecodeState]) -> list[Draft]:
        """Every row's chain, one draft forward per chain step for all rows still drafting (candidates
        are drawn depth by depth, in row order within a depth)."""
        k, R = self.tree.depth, len(states)
        rows = [s.row for s in states]
        z = self._forward(rows, [s.ids[self.seen[s.row]:] for s in states])              # catch up: (R, V)
        drawn = [[] for _ in range(R)]                  # per row: candidates of each depth drafted
        chain_conf = [1.0] * R
        for b in rows:
            self.fed[b] = 0
        active = list(range(R))
        for j in range(k):
            cand = row_candidates(z, 1, vocab=self.vocab, vocab_size=self.vocab_size, state=states[0], draw=True)
            still = []
            # Under a threshold, every row's confidence in one read (on a GPU, one synchronisation a chain step):
            # the chain stops on it, and the tree is cut with it (``_draft_from``), with nothing more to read.
            confs = cand.conf[:, :1].tolist() if self.threshold > 0 else [[1.0]] * len(active)   # (A, 1)
            for i, b in enumerate(active):
                drawn[b].append((cand.tokens[i:i + 1], None if cand.q is None else cand.q[i:i + 1], confs[i]))
                chain_conf[b] *= confs[i][0]                  # the product tree.prune takes
                # Too doubtful to pay for another draft forward, or the chain is full.
                if chain_conf[b] >= self.threshold and j + 1 < k:
                    still.append(b)
            at = [i for i, b in enumerate(active) if b in still]   # the continuing rows' places among the active
            active = still
            if not active:
                break
            drafted = cand.tokens[:, :1] if len(at) == cand.tokens.shape[0] else \
                cand.tokens[torch.tensor(at, device=cand.tokens.device), :1]
            z = self._forward([rows[b] for b in active], drafted)
            for b in active:
                self.fed[rows[b]] += 1
        return [self._draft_from(s, c) for s, c in zip(states, drawn)]

    def _draft_from(self, state: DecodeState, drawn: list) -> Draft:
        """One row's chain draft from its candidates per depth drafted."""
        k = self.tree.depth
        rows = [c[0] for c in drawn]
        pad = k - len(rows)                            # depths never drafted: zero confidence, pruned below
        tree = pruned(self.tree, [c[2] for c in drawn] + [[0.0]] * pad, self.threshold)   # (the host's confidences)
        tokens = layout(tree, state.ids[-1], torch.cat(rows + [rows[0].new_zeros(pad, 1)]))
        q = torch.cat([c[1] for c in drawn]) if state.params.do_sample else None
        return Draft(tree=tree, tokens=tokens, q=q)

    def commit(self, states: list[DecodeState], accepted: list[Accepted], outs: list[TargetOut]) -> None:
        # The cache saw the old pending token and the drafts fed this step; accepted drafts stay valid.
        # A step it did not draft (a plain step of the back-off) fed nothing: the cache stays where it was.
        for s, a in zip(states, accepted):
            row = self.cache.row(s.row)
            valid = min(len(s.ids) - 1 - a.num_accepted + min(a.num_accepted, self.fed[s.row]), row.get_seq_length())
            row.truncate(valid)
            self.seen[s.row], self.fed[s.row] = valid, 0
