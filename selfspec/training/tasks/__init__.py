"""Kinds of trained module, each a :class:`~selfspec.training.tasks.base.Task` run by ``loop.fit``.

``HEAD_TASKS`` maps a train-heads ``--kind`` to its task class; a new kind adds its module here
(and its heads to ``selfspec.heads``). The distilled draft (``tasks.draft``) is train-draft's.
"""

from __future__ import annotations

from .base import Task
from .eagle import EagleTask
from .early_exit import EarlyExitTask
from .heads import HeadsTask
from .medusa import MedusaTask

# kind -> task class, built as cls(config, target=..., device=..., lora=..., heads=...)
HEAD_TASKS: dict[str, type[HeadsTask]] = {
    "medusa": MedusaTask,
    "early-exit": EarlyExitTask,
    "eagle": EagleTask,
}

__all__ = ["HEAD_TASKS", "EagleTask", "EarlyExitTask", "HeadsTask", "MedusaTask", "Task"]
