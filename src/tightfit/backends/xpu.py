"""Intel GPUs through ``torch.xpu``."""

from __future__ import annotations

from tightfit.backends._accelerator import AcceleratorBackend

__all__ = ["XPUBackend"]


class XPUBackend(AcceleratorBackend):
    name = "xpu"
    device_type = "xpu"
    priority = 90
