"""``bitsandbytes.utils``: what code written for bitsandbytes imports from it."""

from __future__ import annotations

import torch

__all__ = ["sync_gpu"]


def sync_gpu(t: torch.Tensor) -> None:
    """Wait for the work queued on ``t``'s device (nothing to wait for on the CPU)."""
    if t.device.type != "cpu":
        torch.get_device_module(t.device.type).synchronize(t.device)
