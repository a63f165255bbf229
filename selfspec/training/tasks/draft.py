"""The distilled draft model as a trained module: its loss, held-out scores and small checkpoint format.

The student is ``truncated_copy(target, L)``: the target's embeddings, first L decoder layers,
final norm and LM head. Embeddings and LM head (one tensor when tied) stay frozen and identical
to the target's, so a checkpoint only has to store the decoder layers and the final norm. The
loss is KL(target's final distribution || student's distribution) at every response position
(same position, no shift: both read the same prefix), on the draft vocabulary of
``frequent_vocab`` with the renormalised convention of ``losses.py``: teacher and student logits
are both ``F.linear(h, lm_head.weight[vocab])``, so full-vocabulary logits are never built.

Why float16 rather than bfloat16 for storage: decoder weights are small (|w| << 65504), so
float16's range is never in play and its 10-bit mantissa rounds 8x finer than bfloat16's 7 bits.
Saving refuses float16 if a tensor would overflow it instead of silently switching.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from ... import __version__
from ...drafters.draft_model import truncated_copy
from ...io import atomic_path, atomic_write_text
from ..config import DraftConfig
from ..features import FeatureCache, Target
from ..losses import HeadLoss, exit_loss
from ..split import Batch, Sequence, collate, length_batches
from .base import EvalResult, Task

META_FILE = "selfspec_draft.json"
WEIGHTS_FILE = "model.safetensors"
SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class DraftEval(EvalResult):
    """EvalResult with one 'head' (the student); ``loss`` is the mean KL to the target."""

    def line(self) -> str:
        return (f"eval step {self.step}: KL {self.loss:.4f}, top-1 agreement {self.top1[0]:.1%}, "
                f"top-5 {self.top5[0]:.1%} ({self.tokens} positions)")


def trained_names(student: torch.nn.Module) -> list[str]:
    """State-dict names the student learns: every parameter but the (frozen, shared) embeddings and LM head."""
    frozen = {id(student.get_input_embeddings().weight), id(student.get_output_embeddings().weight)}
    return [n for n, p in student.named_parameters(remove_duplicate=False) if id(p) not in frozen]


def make_student(model: torch.nn.Module, *, layers: int) -> torch.nn.Module:
    """``truncated_copy`` with embeddings and LM head frozen; layers and final norm trainable, fp32."""
    student = truncated_copy(model, layers).float()
    train = set(trained_names(student))
    for n, p in student.named_parameters(remove_duplicate=False):
        p.requires_grad_(n in train)
    return student


def draft_loss(student: torch.nn.Module, target: Target, batch: Batch, *, device,
               final: torch.Tensor | None = None) -> HeadLoss:
    """Frozen target forward (no grad), student forward, KL at the same positions on the draft vocabulary.

    ``final``: the target's cached post-norm last hidden states for the batch (B, L, H), which
    replace its forward (the expensive half of a step).
    """
    ids, am = batch.input_ids.to(device), batch.attention_mask.to(device)
    window = batch.window.to(device)  # (B, W)
    pick = lambda h: h.gather(1, window[..., None].expand(-1, -1, h.shape[-1]))  # noqa: E731  (B, L, H) -> (B, W, H)
    with torch.no_grad():
        if final is None:
            final = target.backbone.model.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
        teacher = F.linear(pick(final), target.weight)  # (B, W, V_sub)
    h = student.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state  # (B, L, H) post-norm
    z = F.linear(pick(h), target.weight.to(h.dtype))  # (B, W, V_sub): the student's LM head is the target's, frozen
    return exit_loss(z, teacher, batch.mask.to(device), vocab=target.vocab)


@torch.no_grad()
def evaluate_draft(student, target: Target, seqs: list[Sequence], *, batch_size: int, device, step: int,
                   autocast=contextlib.nullcontext, features: FeatureCache | None = None,
                   feature_ids: list[int] | None = None) -> DraftEval | None:
    if not seqs:
        return None
    was_training = student.training
    student.eval()
    kl_sum, top1, top5, count = 0.0, 0.0, 0.0, 0.0
    for part in length_batches(seqs, batch_size):
        final = None if features is None else features.gather([feature_ids[i] for i in part], device=device)[0]
        with autocast():
            r = draft_loss(student, target, collate([seqs[i] for i in part], lead=0), device=device, final=final)
        n = float(r.count[0])
        kl_sum, top1, top5, count = kl_sum + float(r.kl[0]) * n, top1 + float(r.top1[0]) * n, top5 + float(r.top5[0]) * n, count + n
    student.train(was_training)
    d = max(count, 1.0)  # position-weighted means, so the batch size does not change the numbers
    return DraftEval(step=step, loss=kl_sum / d, top1=[top1 / d], top5=[top5 / d], tokens=int(count))


def save_draft(student: torch.nn.Module, out, *, base_model: str, base_fingerprint: str, save_dtype: str = "float16",
               tokenizer=None, extra: dict | None = None, draft_vocab: torch.Tensor | None = None) -> None:
    """Write the small draft directory: config, generation config, tokenizer, trained tensors only, meta last.

    ``draft_vocab``: the token ids it was distilled on, recorded as ``config.selfspec_draft_vocab`` so
    that selfspec's draft-model drafter scores only those LM-head rows (transformers ignores it).
    """
    from safetensors.torch import save_file

    if save_dtype not in SAVE_DTYPES:
        raise ValueError(f"unknown save dtype {save_dtype!r}: use float16 or bfloat16")
    dtype = SAVE_DTYPES[save_dtype]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = set(trained_names(student))
    sd = student.state_dict()
    tensors = {n: t.detach().to("cpu", dtype).contiguous() for n, t in sd.items() if n in names}
    big = [n for n, t in sd.items() if n in names and t.abs().max() > torch.finfo(dtype).max]
    if big:
        raise ValueError(f"{big[0]} overflows {save_dtype}: save with save_dtype='bfloat16'")
    config = copy.deepcopy(student.config)
    if draft_vocab is not None:
        config.selfspec_draft_vocab = [int(t) for t in draft_vocab.tolist()]
    config.save_pretrained(out)
    student.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    with atomic_path(out / WEIGHTS_FILE) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    meta = {"base_model": base_model, "base_fingerprint": base_fingerprint, "shared": sorted(set(sd) - names),
            "dtype": save_dtype, "num_layers": student.config.num_hidden_layers, "selfspec_version": __version__,
            **({"training": extra} if extra else {})}
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2, default=str) + "\n")   # last: marks the directory complete


@dataclass
class DraftTask(Task):
    """train-draft's student under the shared loop: ``draft_loss``, ``evaluate_draft``, ``save_draft``."""

    config: DraftConfig
    target: Target
    device: torch.device | str
    layers: int
    base_model: str                    # recorded in selfspec_draft.json: what materialize_draft loads
    base_fingerprint: str
    vocab: torch.Tensor | None         # the draft vocabulary the loss used, recorded in the draft's config
    tokenizer: object = None

    lead = 0  # same position: the student imitates the target's distribution at the row it reads
    eval_class = DraftEval

    def loss(self, module, batch, *, features=None) -> HeadLoss:
        final = None if features is None else features[0]
        return draft_loss(module, self.target, batch, device=self.device, final=final)

    def evaluate(self, module, seqs, *, step, autocast=contextlib.nullcontext, features=None,
                 feature_ids=None) -> DraftEval | None:
        return evaluate_draft(module, self.target, seqs, batch_size=self.config.batch_size, device=self.device,
                              step=step, autocast=autocast, features=features, feature_ids=feature_ids)

    def state_entries(self, module) -> dict:
        sd = module.state_dict()
        return {"student": {n: sd[n].detach().cpu() for n in trained_names(module)}, "layers": self.layers}

    def save(self, module, out: Path, *, record: dict) -> None:
        save_draft(module, out, base_model=self.base_model, base_fingerprint=self.base_fingerprint,
                   save_dtype=self.config.save_dtype, tokenizer=self.tokenizer, extra=record, draft_vocab=self.vocab)
