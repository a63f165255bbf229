"""Two-model baseline: a separate small causal LM (same tokenizer) drafts a chain of k tokens.

The draft model keeps its own KV cache (a ``cache.KVCache``), run layer by layer through a
``Backbone`` as the target is, so it must be of a supported family. It has seen a prefix of the
committed tokens; each step it first catches up on the tokens it has not seen (the pending
token, plus the last draft when the whole chain was accepted), then drafts k - 1 more.

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

Precision: the draft runs in ``draft_dtype`` (bfloat16 for a float32 target on a CPU with BF16
instructions, where its forward is mostly weight reads), on a copy when the given model is in
another dtype; ``dtype=`` overrides. Drafts only propose, so this never changes the output.
"""

from __future__ import annotations

import copy

import torch

from .. import cache as kv
from ..backbone import Backbone
from ..projection import Projection
from ..tree import Tree, additive_mask
from ..verify import Accepted
from .base import DecodeState, Draft, Drafter, TargetOut, check_threshold, draft_dtype, layout, pruned, row_candidates


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
        self.dtype = dtype or draft_dtype(w.device, w.dtype)
        # A copy in the drafting dtype when it differs: the caller's model (which transformers'
        # assisted generation may also be using, as in the bench) stays as it was.
        self.model = draft_model if self.dtype == w.dtype else copy.deepcopy(draft_model).to(self.dtype)
        self.backbone = Backbone(self.model)
        self.tree = tree
        self.vocab_size = vocab_size
        self.threshold = check_threshold(threshold)
        self.cache = kv.new_cache()
        self.seen = 0  # tokens of state.ids in self.cache
        self.fed = 0   # drafted tokens fed to the cache in the last step
        subset = getattr(draft_model.config, "selfspec_draft_vocab", None)
        w = self.model.get_output_embeddings().weight
        self.vocab = None if subset is None else torch.as_tensor(subset, dtype=torch.long, device=w.device)
        # Scores only the target's vocabulary (or the draft's subset of it), in the fastest layout.
        b = getattr(self.model.get_output_embeddings(), "bias", None)
        rows = slice(0, vocab_size) if self.vocab is None else self.vocab
        self.project = Projection(w[rows], None if b is None else b[rows])

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def begin(self, state: DecodeState, prefill: TargetOut) -> None:
        self.cache = kv.new_cache()
        self.seen = 0

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed ids after the seen prefix -> logits (V,) for the next token (V_draft with a draft vocabulary)."""
        bb, n, past = self.backbone, len(ids), self.seen
        x = torch.tensor(ids, device=self.device)
        pos = torch.arange(past, past + n, device=self.device)[None]
        mask = None   # one query sees its whole cache; n on an empty cache is plain causal
        if n > 1 and past > 0:
            tri = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            mask = additive_mask(torch.cat([tri.new_ones(n, past), tri], dim=1), bb.dtype)
        self.seen += n
        h = bb.run_layers(bb.embed(x), start=0, end=bb.num_layers, position_ids=pos, attention_mask=mask,
                          cache=self.cache)
        return self.project(bb.final_norm(h[0, -1:]))[0].float()

    @torch.no_grad()
    def draft(self, state: DecodeState) -> Draft:
        k = self.tree.depth
        z = self._forward(state.ids[self.seen:])
        rows, qs, confs, chain_conf, self.fed = [], [], [], 1.0, 0
        for j in range(k):
            cand = row_candidates(z[None], 1, vocab=self.vocab, vocab_size=self.vocab_size, state=state)
            rows.append(cand.tokens)
            qs.append(cand.q)
            confs.append(cand.conf)
            chain_conf *= float(cand.conf[0, 0])       # the product tree.prune takes
            if chain_conf < self.threshold:
                break                                  # too doubtful to pay for another draft forward
            if j + 1 < k:
                z = self._forward([int(cand.tokens[0, 0])])
                self.fed += 1
        pad = k - len(rows)                            # depths never drafted: zero confidence, pruned below
        tree = pruned(self.tree, torch.cat(confs + [confs[0].new_zeros(pad, 1)]), self.threshold)
        tokens = layout(tree, state.ids[-1], torch.cat(rows + [rows[0].new_zeros(pad, 1)]))
        q = torch.cat(qs) if state.params.do_sample else None
        return Draft(tree=tree, tokens=tokens, q=q)

    def commit(self, state: DecodeState, accepted: Accepted, out: TargetOut) -> None:
        # The cache saw the old pending token and the drafts fed this step; accepted drafts stay valid.
        valid = len(state.ids) - 1 - accepted.num_accepted + min(accepted.num_accepted, self.fed)
        kv.truncate(self.cache, valid)
        self.seen = valid
