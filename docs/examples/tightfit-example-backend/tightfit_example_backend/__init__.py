"""A tightfit backend plugin for an imaginary accelerator, the NPU (torch device type "npu").

The vendor's torch extension is assumed to provide ``torch.npu`` with the CUDA-style
device API (``is_available``, ``mem_get_info``, ``memory_allocated``, ...). Without it,
as on a machine with only a CPU, the backend loads and reports itself unavailable.

tightfit imports this module when it first looks for backends, so importing it must be
cheap and touch no device; it is also the place to register the plugin's kernels.
"""

from __future__ import annotations

import torch

from tightfit.backends import Backend, Capabilities, MemoryInfo
from tightfit.ops import register_kernel

__all__ = ["NPUBackend"]

# torch.library only dispatches on device types torch knows. An out-of-tree device gets
# one by naming torch's PrivateUse1 slot; the vendor's extension does that when it is
# imported, so name it here only if nobody has. If another device already holds the
# slot, this raises and tightfit lists the plugin as failed to load, with this error.
try:
    torch.device("npu")
except RuntimeError:
    torch.utils.rename_privateuse1_backend("npu")


class NPUBackend(Backend):
    """The NPU as tightfit sees it: every method is a thin call into ``torch.npu``."""

    name = "npu"
    device_type = "npu"
    priority = 50  # above the CPU (0): when an NPU is present it is the default

    def _is_available(self) -> bool:
        npu = getattr(torch, "npu", None)
        return npu is not None and npu.is_available()

    def _capabilities(self) -> Capabilities:
        compute = frozenset({torch.float32, torch.float16, torch.bfloat16})
        return Capabilities(
            storage_dtypes=compute | {torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2},
            compute_dtypes=compute,
            async_copy=True,
        )

    def _memory(self, device: torch.device) -> MemoryInfo:
        free, total = torch.npu.mem_get_info(device)
        return MemoryInfo(
            total=total,
            free=free,
            allocated=torch.npu.memory_allocated(device),
            peak=torch.npu.max_memory_allocated(device),
            source="torch.npu caching allocator",
        )

    def _reset_peak_memory(self, device: torch.device) -> None:
        torch.npu.reset_peak_memory_stats(device)

    def _synchronize(self, device: torch.device) -> None:
        torch.npu.synchronize(device)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The NPU converts dtypes in its own copy kernel. Registering this marks that path as
    native, so ``tightfit.ops.cast`` on the NPU neither warns nor fails in strict mode."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _cast_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """``cast(x, dtype, out=buffer)`` dispatches here: the same conversion into ``out``."""
    out.copy_(x)


register_kernel("cast", "npu", _cast, label="npu copy_")
register_kernel("cast_into", "npu", _cast_into, label="npu copy_")
