"""An exit head: reads the states after layer E and imitates the final layer at the same position.

Its output goes through the frozen final norm and the same restricted LM head, exactly as the
drafter uses it.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..losses import HeadLoss, exit_loss
from .heads import HeadsTask, TargetPass


class EarlyExitTask(HeadsTask):
    lead = 0  # same position: the teacher row is the head's own
    reads_exit_layer = True

    def head_loss(self, module: torch.nn.Module, states: TargetPass) -> HeadLoss:
        target, bb, full_e = self.target, self.target.backbone, states.exit_states
        if self.config.exit_adapter == "layer":
            # The layer adapter attends over earlier positions: run it causally on the whole sequence
            # (right padding only follows the real tokens), then read the window.
            pos = torch.arange(full_e.shape[1], device=self.device)[None].expand(full_e.shape[0], -1)
            adapted = module(full_e, position_embeddings=bb.rotary_emb(full_e, position_ids=pos), position_ids=pos)
            z = F.linear(bb.final_norm(states.pick(adapted)), target.weight)  # (B, W, V_sub)
        else:
            z = F.linear(bb.final_norm(module(states.pick(full_e))), target.weight)  # (B, W, V_sub)
        return exit_loss(z, states.teacher, states.mask, hard_tokens=states.next_tokens,
                         hard_weight=self.config.hard_weight, vocab=target.vocab)
