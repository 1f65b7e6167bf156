"""Shared code for backends whose torch device module (``torch.cuda``, ``torch.xpu``, ...)
follows the CUDA-style memory API. Not public: vendors subclass :class:`Backend`."""

from __future__ import annotations

from types import ModuleType

import torch

from tightfit.backends.base import FLOAT8_DTYPES, INTEGER_DTYPES, RUNTIME_HINTS, Backend, Capabilities, MemoryInfo

__all__: list[str] = []

_BASE_COMPUTE = frozenset({torch.float32, torch.float16, torch.bfloat16})


class AcceleratorBackend(Backend):
    """A backend driven through ``torch.<device_type>``."""

    def _module(self) -> ModuleType | None:
        return getattr(torch, self.device_type, None)

    def _is_available(self) -> bool:
        module = self._module()
        return bool(module is not None and module.is_available())

    def _compute_dtypes(self) -> frozenset[torch.dtype]:
        return _BASE_COMPUTE

    def _capabilities(self) -> Capabilities:
        compute = self._compute_dtypes()
        return Capabilities(
            storage_dtypes=frozenset(compute | {torch.float32} | INTEGER_DTYPES | FLOAT8_DTYPES),
            compute_dtypes=compute,
            async_copy=True,
            unified_memory=False,
            paged_memory=False,
            hints=RUNTIME_HINTS,
        )

    def _memory(self, device: torch.device) -> MemoryInfo:
        module = self._module()
        free = total = None
        if hasattr(module, "mem_get_info"):
            free, total = module.mem_get_info(device)
        return MemoryInfo(
            total=total,
            free=free,
            allocated=module.memory_allocated(device),
            peak=module.max_memory_allocated(device),
            source=f"torch.{self.device_type} caching allocator",
        )

    def _reset_peak_memory(self, device: torch.device) -> None:
        self._module().reset_peak_memory_stats(device)

    def _synchronize(self, device: torch.device) -> None:
        self._module().synchronize(device)
