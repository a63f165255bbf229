"""Drafter registry: name -> drafter class. ``none`` is plain autoregressive decoding."""

from __future__ import annotations

import torch

from ..core.tree import Tree, build_tree
from ..core.types import DecodeState, Draft, Drafter, Resume, TargetOut, plain_draft
from ..settings import DRAFTER_SETTINGS, check_drafter_name
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .early_exit import EarlyExitDrafter
from .lookup import LookupDrafter
from .medusa import MedusaDrafter


class NoDrafter(Drafter):
    """Drafts nothing: every step verifies the pending token alone (plain decoding, selfspec's loop)."""

    name = "none"

    def __init__(self, device: torch.device):
        self.tree = build_tree((), str(device))
        self.device = device

    def draft(self, states: list[DecodeState]) -> list[Draft]:
        return [plain_draft(s, self.device) for s in states]


DRAFTERS: dict[str, type[Drafter]] = {
    "none": NoDrafter,
    "early-exit": EarlyExitDrafter,
    "medusa": MedusaDrafter,
    "draft-model": DraftModelDrafter,
    "lookup": LookupDrafter,
    "eagle": EagleDrafter,
}


assert DRAFTERS.keys() == DRAFTER_SETTINGS.keys(), "every drafter declares its settings (settings.DRAFTER_SETTINGS)"


__all__ = ["DRAFTERS", "Draft", "DecodeState", "Drafter", "Resume", "TargetOut", "Tree", "check_drafter_name",
           "DraftModelDrafter", "EagleDrafter", "EarlyExitDrafter", "LookupDrafter", "MedusaDrafter", "NoDrafter"]
