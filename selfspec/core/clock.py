"""The one clock: the decode's wall time and every measurement the runtime takes read it."""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    """Seconds, read once ``device`` has finished its queued work (a CUDA device runs ahead of the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
