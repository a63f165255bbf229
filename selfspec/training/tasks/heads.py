"""What every train-heads kind shares: the frozen target's pass, held-out scores, the heads directory.

The backbone is frozen. Per micro-batch: one no-grad forward of the target over the padded
sequences gives the final post-norm hidden states (Medusa input, and the teacher) and, for early
exit, the hidden states after layer E. Only a window around each response is kept (the rows that
carry signal), the teacher logits are computed on the draft vocabulary alone
(``F.linear(h, lm_head.weight[vocab])``: full-vocabulary logits are never built), and the heads
run forward + backward on that window (each kind's ``head_loss``).

With LoRA on the backbone (Medusa-2): the teacher is the ORIGINAL model (adapters disabled, no
grad); the heads read the fine-tuned backbone's hidden states, and the backbone adds its own
self-distillation loss, KL(original || fine-tuned) over the full vocabulary.

A kind saves a heads directory (``selfspec.heads.save_heads``: config.json + model.safetensors,
with ``draft_vocab``), plus ``lora/`` when the backbone was fine-tuned.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch.nn import functional as F

from ...heads import Heads, save_heads
from ..checkpoint import atomic_save_adapter
from ..config import TrainConfig
from ..features import FeatureCache, Target
from ..losses import HeadLoss
from ..split import Batch, Sequence, collate, length_batches
from .base import EvalResult, Task


def window_rows(h: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """(B, L, H) states -> (B, W, H): the rows at each sequence's window positions."""
    return h.gather(1, window[..., None].expand(-1, -1, h.shape[-1]))


@dataclass
class TargetPass:
    """The frozen target's states for one batch's window, as a head kind's loss reads them."""

    window: torch.Tensor                  # (B, W) positions into L
    final: torch.Tensor                   # (B, W, H) the original model's post-norm last hidden states
    teacher: torch.Tensor                 # (B, W, V_sub) its logits on the draft vocabulary
    exit_states: torch.Tensor | None      # (B, L, H) after the exit layer (fine-tuned backbone's with LoRA); whole sequences
    student_final: torch.Tensor | None    # (B, W, H) the fine-tuned backbone's post-norm states (LoRA only)
    backbone_kl: torch.Tensor | None      # () KL(original || fine-tuned) over the response rows (LoRA only)
    mask: torch.Tensor                    # (B, W) response rows
    next_tokens: torch.Tensor             # (B, W)

    def pick(self, h: torch.Tensor) -> torch.Tensor:
        return window_rows(h, self.window)

    @property
    def head_input(self) -> torch.Tensor:
        """The final states the heads read: the fine-tuned backbone's when it is trained, else the original's."""
        return self.student_final if self.student_final is not None else self.final


def target_pass(target: Target, batch: Batch, *, device, lora=None, exit_states: bool = False,
                features: tuple[torch.Tensor, torch.Tensor] | None = None) -> TargetPass:
    """The target's forward on ``batch`` (or its cached ``features``), the teacher, and with ``lora``
    the fine-tuned backbone's forward and its KL to the original."""
    bb = target.backbone
    ids, am = batch.input_ids.to(device), batch.attention_mask.to(device)
    window = batch.window.to(device)  # (B, W)
    pick = lambda h: window_rows(h, window)  # noqa: E731
    with torch.no_grad(), (lora.disable_adapter() if lora is not None else contextlib.nullcontext()):
        if features is not None:  # cached backbone states (B, L, H): (final post-norm, after layer E)
            final_full, full_e = features
        else:
            out = bb.model.model(input_ids=ids, attention_mask=am, output_hidden_states=exit_states, use_cache=False)
            final_full = out.last_hidden_state
            full_e = out.hidden_states[target.exit_layer] if exit_states else None  # (B, L, H)
        final = pick(final_full)                                # (B, W, H) post-norm
        teacher = F.linear(final, target.weight)                # (B, W, V_sub)
    mask, next_tokens = batch.mask.to(device), batch.next_tokens.to(device)
    s_final, backbone_kl = None, None
    if lora is not None:
        student = bb.model.model(input_ids=ids, attention_mask=am, output_hidden_states=exit_states, use_cache=False)
        s_final = pick(student.last_hidden_state)
        full_e = student.hidden_states[target.exit_layer] if exit_states else None
        w_full = bb.lm_head.weight
        t_logp = F.log_softmax(F.linear(final, w_full).float(), -1)      # (B, W, V)
        s_logp = F.log_softmax(F.linear(s_final, w_full).float(), -1)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)                  # (B, W)
        backbone_kl = (kl * mask).sum() / mask.sum().clamp(min=1)
    return TargetPass(window=window, final=final, teacher=teacher, exit_states=full_e, student_final=s_final,
                      backbone_kl=backbone_kl, mask=mask, next_tokens=next_tokens)


@dataclass
class HeadsTask(Task):
    """A train-heads kind: ``head_loss`` is its own; the target pass, evaluation and saving are shared.

    ``heads`` (its config and draft vocabulary) is what ``save`` writes around the trained module;
    a task built for scoring alone needs none.
    """

    config: TrainConfig
    target: Target
    device: torch.device | str
    lora: object = None            # the peft model wrapping the backbone (Medusa-2), or None
    heads: Heads | None = None

    reads_exit_layer: ClassVar[bool] = False  # whether head_loss needs the states after the exit layer
    caches_features: ClassVar[bool] = True    # whether the one-off feature cache (final + exit layer) serves its loss
    eval_columns: ClassVar[str] = "head"      # what its per-column held-out scores are (EvalResult.by)

    @abstractmethod
    def head_loss(self, module: torch.nn.Module, states: TargetPass) -> HeadLoss:
        """The heads' forward on the window and their distillation loss against ``states.teacher``."""

    def loss(self, module, batch, *, features=None) -> HeadLoss:
        states = target_pass(self.target, batch, device=self.device, lora=self.lora,
                             exit_states=self.reads_exit_layer, features=features)
        r = self.head_loss(module, states)
        return r if states.backbone_kl is None else dataclasses.replace(r, loss=r.loss + states.backbone_kl)

    @torch.no_grad()
    def evaluate(self, module, seqs: list[Sequence], *, step: int, autocast=contextlib.nullcontext,
                 features: FeatureCache | None = None, feature_ids: list[int] | None = None) -> EvalResult | None:
        if not seqs:
            return None
        was_training = module.training
        module.eval()
        size = self.config.batch_size
        terms, correct1, correct5, count = 0.0, 0.0, 0.0, 0.0
        for part in length_batches(seqs, size):   # the sums below do not depend on how rows are batched
            with autocast():
                feats = None if features is None else features.gather([feature_ids[i] for i in part], device=self.device)
                r = self.loss(module, collate([seqs[i] for i in part], lead=self.lead), features=feats)
            terms = terms + r.terms.detach().float().cpu()
            correct1, correct5, count = correct1 + r.top1 * r.count, correct5 + r.top5 * r.count, count + r.count
        module.train(was_training)
        denom = count.clamp(min=1)
        # Each head's loss over all held-out positions at once: the same number whatever the batch size.
        return EvalResult(step=step, loss=float((terms / denom).sum()), top1=(correct1 / denom).tolist(),
                          top5=(correct5 / denom).tolist(), tokens=int(count[0]), by=self.eval_columns)

    def state_entries(self, module) -> dict:
        entries = {"heads": {k: v.detach().cpu() for k, v in module.state_dict().items()}}
        if self.lora is not None:
            from peft import get_peft_model_state_dict

            entries["lora"] = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(self.lora).items()}
        return entries

    def save(self, module, out: Path, *, record: dict) -> None:
        self.heads.config.provenance = record
        save_heads(Heads(config=self.heads.config, module=module, draft_vocab=self.heads.draft_vocab), out)
        if self.lora is not None:
            atomic_save_adapter(self.lora, out / "lora")
