"""Intel Gaudi through ``habana_frameworks.torch``, which provides ``torch.hpu``."""

from __future__ import annotations

import importlib
import importlib.util

from tightfit.backends._accelerator import AcceleratorBackend

__all__ = ["HPUBackend"]


class HPUBackend(AcceleratorBackend):
    name = "hpu"
    device_type = "hpu"
    priority = 85

    def _is_available(self) -> bool:
        if importlib.util.find_spec("habana_frameworks") is None:
            return False
        importlib.import_module("habana_frameworks.torch.core")  # registers torch.hpu
        return super()._is_available()
