"""Training the EAGLE-3-class feature head: self-distillation with a training-time test.

Per micro-batch, one frozen forward of the target (no grad) over the padded sequences gives the
hidden states after the head's aux layers (its input) and the final states, whose logits on the
draft vocabulary are the teacher. The head then runs ``steps`` times over every slot at once,
as it will draft (``EagleHead.ttt_step``): step 0 reads the target's fused features, step j reads
step j - 1's output states from the previous slot, and attends to the committed slots up to
i - j plus its own draft ancestors. Every step's slot i predicts token i + 2, whose teacher is the
target's row i + 1, so one sequence trains all draft depths at once. Loss:
sum_j decay^j KL(target || draft_j) over the draft vocabulary (renormalised, as for the other
heads: ``losses.py``), averaged over response rows.

Sequences come in as ``Sequence`` rows (prompt + response ids); for rows from
``gen-data --references`` the response is a reference text (teacher forcing), and the teacher
is still the target's own distribution at each position.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ...core.backbone import Backbone
from ...models.eagle import EagleHead
from ..losses import HeadLoss
from ..split import Batch, collate
from .heads import HeadsTask

DEFAULT_TTT_STEPS = 4        # unrolled draft steps per training position (>= 3: depth the head learns to keep up)
DEFAULT_STEP_DECAY = 0.8     # step j's loss weight is decay ** j


def pad_batch(seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, L) ids, attention mask, and ``rows`` (B, L) bool: row j is a response row
    (the target at j predicts response token j + 1)."""
    batch = collate(seqs, lead=0)
    return batch.input_ids, batch.attention_mask, response_rows(batch)


@torch.no_grad()
def target_pass(backbone: Backbone, ids: torch.Tensor, am: torch.Tensor, *, aux_layers, lm_weight: torch.Tensor | None,
                autocast=contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Frozen target over (B, L): (aux hidden states concatenated (B, L, A*H) float32, teacher logits
    (B, L, V_draft) on the LM-head rows ``lm_weight``, or None without them)."""
    with autocast():
        out = backbone.model.model(input_ids=ids, attention_mask=am, output_hidden_states=True, use_cache=False)
        aux = torch.cat([out.hidden_states[a] for a in aux_layers], dim=-1)
        teacher = None if lm_weight is None else F.linear(out.last_hidden_state, lm_weight.to(out.last_hidden_state.dtype))
    return aux.float(), None if teacher is None else teacher.float()


def ttt_loss(head: EagleHead, backbone: Backbone, ids: torch.Tensor, am: torch.Tensor, rows: torch.Tensor, *,
             aux: torch.Tensor, teacher: torch.Tensor, steps: int = DEFAULT_TTT_STEPS,
             decay: float = DEFAULT_STEP_DECAY, hard_weight: float = 0.0) -> HeadLoss:
    """The unrolled loss of one batch; per-step diagnostics as ``HeadLoss`` rows (K = steps).

    ids, am, rows: (B, L) from ``pad_batch``; aux (B, L, A*H) and teacher (B, L, V_draft) from
    ``target_pass``. ``hard_weight`` > 0 adds that much cross-entropy on the teacher's top token to each
    step's KL: greedy verification accepts a draft token only where it is the target's top one."""
    B, L = ids.shape
    dev = ids.device
    feature = head.fuse(aux)                                                   # (B, L, H)
    with torch.no_grad():
        nxt = torch.cat([ids[:, 1:], ids.new_zeros(B, 1)], dim=1)            # slot i reads token i + 1
        emb = backbone.embed_tokens(nxt).float()
        pos = torch.arange(L, device=dev)[None]
        pos_emb = tuple(t.float() for t in backbone.rotary_emb(emb, position_ids=pos))
        # Slot i's teacher is row i + 1; it counts where that row is a response row. Only those
        # slots go through the LM head (the draft-vocabulary logits dominate the head's cost).
        signal = F.pad(rows[:, 1:] & am[:, 1:].bool(), (0, 1))                # (B, L)
    past, total = [], feature.new_zeros(())
    kls, top1s, top5s, counts, terms = [], [], [], [], []
    for j in range(steps):
        states, kv = head.ttt_step(feature, emb, position_embeddings=pos_emb, past=past)
        past.append(kv)
        valid = signal.clone()
        valid[:, :j] = False                                                   # slot i needs i - j >= 0
        n = int(valid.sum())
        if n:
            with torch.no_grad():
                log_p = teacher[:, 1:][valid[:, :-1]].log_softmax(-1)          # (n, V)
            logits = head.logits(states[valid])                                # (n, V)
            log_q = logits.float().log_softmax(-1)
            want = log_p.argmax(-1)
            kl_sum = (log_p.exp() * (log_p - log_q)).sum()
            step_sum = kl_sum - hard_weight * log_q.gather(1, want[:, None]).sum() if hard_weight > 0 else kl_sum
            total = total + decay ** j * step_sum / n
            terms.append(decay ** j * step_sum)
            with torch.no_grad():
                top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                top1s.append(float((top[:, 0] == want).sum()))
                top5s.append(float((top == want[:, None]).any(-1).sum()))
                kls.append(float(kl_sum))
        else:
            top1s.append(0.0), top5s.append(0.0), kls.append(0.0)
            terms.append(states.sum() * 0.0)
        counts.append(float(n))
        # The next step's slot i reads this step's output at slot i - 1 (the draft's own state).
        feature = F.pad(states, (0, 0, 1, 0))[:, :L]
    c = torch.tensor(counts).clamp(min=1)
    return HeadLoss(loss=total, kl=torch.tensor(kls) / c, top1=torch.tensor(top1s) / c, top5=torch.tensor(top5s) / c,
                    count=torch.tensor(counts), terms=torch.stack([t.float() for t in terms]))


def response_rows(batch: Batch) -> torch.Tensor:
    """(B, L) bool from a collated batch: row j is a response row (its window says so)."""
    rows = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    return rows.scatter(1, batch.window, batch.mask)


@dataclass
class EaglePass:
    """The frozen target's view of one batch, as the eagle head's loss reads it (whole sequences)."""

    ids: torch.Tensor        # (B, L)
    am: torch.Tensor         # (B, L)
    rows: torch.Tensor       # (B, L) response rows
    aux: torch.Tensor        # (B, L, A*H) hidden states after the aux layers
    teacher: torch.Tensor    # (B, L, V_draft)


class EagleTask(HeadsTask):
    """``train-heads --kind eagle``: the training-time-test loss above, over whole sequences.

    Online: the frozen target runs inside every step (its three aux layers of features are too big
    to cache: 3 x H values per token), under bfloat16 autocast when ``feature_dtype`` says so.
    Per-"head" diagnostics are per unrolled step."""

    lead = 0
    caches_features = False
    eval_columns = "draft step"

    def loss(self, module, batch, *, features=None) -> HeadLoss:
        dev = self.device
        ids, am = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        autocast = (lambda: torch.autocast(torch.device(dev).type, dtype=torch.bfloat16)) \
            if self.config.feature_dtype == "bfloat16" else contextlib.nullcontext
        aux, teacher = target_pass(self.target.backbone, ids, am, aux_layers=self.heads.config.aux_layers,
                                   lm_weight=self.target.weight, autocast=autocast)
        # "all": every row the target ran over teaches the head (prompt rows too), not only the response's.
        rows = am[:, :].bool() if self.config.loss_rows == "all" else response_rows(batch).to(dev)
        return self.head_loss(module, EaglePass(ids=ids, am=am, rows=rows, aux=aux, teacher=teacher))

    def head_loss(self, module, states: EaglePass) -> HeadLoss:
        return ttt_loss(module, self.target.backbone, states.ids, states.am, states.rows, aux=states.aux,
                        teacher=states.teacher, steps=self.config.ttt_steps, decay=self.config.head_weight_base,
                        hard_weight=self.config.hard_weight)
