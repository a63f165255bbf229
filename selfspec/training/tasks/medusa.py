"""Medusa heads: head k, reading position t (and the root token that followed it), learns the
target's distribution for the token at t + k + 2 (see ``losses.medusa_loss``)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..losses import HeadLoss, medusa_loss
from .heads import HeadsTask, TargetPass


class MedusaTask(HeadsTask):
    @property
    def lead(self) -> int:
        return self.config.num_heads  # the last head's teacher row lies num_heads rows past its position

    def head_loss(self, module: torch.nn.Module, states: TargetPass) -> HeadLoss:
        target, config = self.target, self.config
        with torch.no_grad():  # the root each head row hangs under: the token that followed the position
            roots = target.backbone.embed_tokens(states.next_tokens)  # (B, W, H)
        z = F.linear(module(states.head_input, roots), target.weight)  # (B, W, K, V_sub)
        return medusa_loss(z, states.teacher, states.mask, weight_decay_base=config.head_weight_base,
                           hard_tokens=states.next_tokens, hard_weight=config.hard_weight, vocab=target.vocab)
