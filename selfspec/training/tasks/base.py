"""The interface a kind of trained module implements to run under the shared loop (``loop.fit``).

A task owns everything kind-specific: how wide a window its loss reads (``lead``), the loss of a
micro-batch, the held-out evaluation, the tensors it keeps in ``trainer_state.pt`` and the
artefact it saves. Batching, the optimizer, resume and the checkpoint cadence are the loop's.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..features import FeatureCache
from ..losses import HeadLoss
from ..split import Batch, Sequence


@dataclass
class EvalResult:
    step: int
    loss: float
    top1: list[float]  # per head (EAGLE: per draft step)
    top5: list[float]
    tokens: int
    by: str = "head"   # what the columns are: "head", or "draft step" for an EAGLE head's unrolled steps

    def line(self) -> str:
        acc = " ".join(f"{a:.1%}/{b:.1%}" for a, b in zip(self.top1, self.top5))
        return f"eval step {self.step}: loss {self.loss:.4f}, top-1/top-5 by {self.by}: {acc} ({self.tokens} positions)"


class Task(ABC):
    """One kind of trained module (Medusa heads, an exit head, a distilled draft, ...)."""

    eval_class: ClassVar[type[EvalResult]] = EvalResult  # what ``evaluate`` returns; resume rebuilds the history with it

    @property
    @abstractmethod
    def lead(self) -> int:
        """How many target rows past a window position the loss reads (``collate``'s ``lead``)."""

    @abstractmethod
    def loss(self, module: torch.nn.Module, batch: Batch, *,
             features: tuple[torch.Tensor, torch.Tensor] | None = None) -> HeadLoss:
        """The micro-batch's loss. ``features``: the cached (final post-norm, after the exit layer)
        backbone states of the batch, each (B, L, H), standing in for a backbone forward; None: run it."""

    @abstractmethod
    def evaluate(self, module: torch.nn.Module, seqs: list[Sequence], *, step: int,
                 autocast=contextlib.nullcontext, features: FeatureCache | None = None,
                 feature_ids: list[int] | None = None) -> EvalResult | None:
        """Held-out scores of ``module`` on ``seqs`` (None when there are none); ``feature_ids``
        index ``seqs`` into ``features``."""

    @abstractmethod
    def state_entries(self, module: torch.nn.Module) -> dict:
        """This kind's entries in ``trainer_state.pt``: its trained tensors (CPU) and what its resume check reads."""

    @abstractmethod
    def save(self, module: torch.nn.Module, out: Path, *, record: dict) -> None:
        """Write the usable artefact into ``out``; ``record`` describes the run (data, step, last eval, config)."""
