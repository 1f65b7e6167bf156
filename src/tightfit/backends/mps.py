"""Apple silicon GPUs through ``torch.mps``: unified memory, no per-device peak counter."""

from __future__ import annotations

import torch

from tightfit.backends._accelerator import AcceleratorBackend
from tightfit.backends.base import INTEGER_DTYPES, Capabilities, MemoryInfo

__all__ = ["MPSBackend"]


class MPSBackend(AcceleratorBackend):
    name = "mps"
    device_type = "mps"
    priority = 80

    def _capabilities(self) -> Capabilities:
        compute = frozenset({torch.float32, torch.float16, torch.bfloat16})
        return Capabilities(
            storage_dtypes=compute | INTEGER_DTYPES,
            compute_dtypes=compute,
            async_copy=False,
            unified_memory=True,
            paged_memory=False,
        )

    def _memory(self, device: torch.device) -> MemoryInfo:
        return MemoryInfo(
            total=torch.mps.recommended_max_memory(),
            free=None,
            allocated=torch.mps.current_allocated_memory(),
            peak=None,  # torch.mps keeps no peak statistic
            source="torch.mps allocator",
        )

    def _reset_peak_memory(self, device: torch.device) -> None:
        return None

    def _synchronize(self, device: torch.device) -> None:
        torch.mps.synchronize()
