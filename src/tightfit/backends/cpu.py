"""The CPU backend: always available; memory figures come from the process and the OS."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tightfit.backends.base import FLOAT8_DTYPES, INTEGER_DTYPES, RUNTIME_HINTS, Backend, Capabilities, MemoryInfo

__all__ = ["CPUBackend", "read_process_memory", "reset_process_peak"]

_STATUS = Path("/proc/self/status")
_MEMINFO = Path("/proc/meminfo")


def _read_kib_fields(path: Path, names: tuple[str, ...]) -> dict[str, int]:
    """Read ``Name:  123 kB`` lines of a /proc file as bytes; missing file gives {}."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            found[key] = int(rest.split()[0]) * 1024
    return found


def read_process_memory() -> tuple[int | None, int | None]:
    """Current and peak resident set size of this process in bytes (VmRSS, VmHWM)."""
    fields = _read_kib_fields(_STATUS, ("VmRSS", "VmHWM"))
    if fields:
        return fields.get("VmRSS"), fields.get("VmHWM")
    try:  # not Linux: ru_maxrss is the peak (bytes on macOS, KiB elsewhere)
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return None, peak if sys.platform == "darwin" else peak * 1024
    except (ImportError, OSError):
        return None, None


def reset_process_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs``); False where the OS cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class CPUBackend(Backend):
    """Host CPU. ``allocated`` and ``peak`` are the process's RSS and peak RSS."""

    name = "cpu"
    device_type = "cpu"
    priority = 0

    def _is_available(self) -> bool:
        return True

    def _capabilities(self) -> Capabilities:
        compute = {torch.float32, torch.float64, torch.bfloat16, torch.float16}
        storage = compute | INTEGER_DTYPES | FLOAT8_DTYPES
        return Capabilities(
            storage_dtypes=frozenset(storage),
            compute_dtypes=frozenset(compute),
            async_copy=False,
            unified_memory=True,
            paged_memory=False,
            hints=RUNTIME_HINTS,
        )

    def _memory(self, device: torch.device) -> MemoryInfo:
        fields = _read_kib_fields(_MEMINFO, ("MemTotal", "MemAvailable"))
        total = fields.get("MemTotal")
        if total is None and hasattr(os, "sysconf"):
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        rss, peak = read_process_memory()
        return MemoryInfo(total=total, free=fields.get("MemAvailable"), allocated=rss, peak=peak, source="process RSS")

    def _reset_peak_memory(self, device: torch.device) -> None:
        reset_process_peak()

    def _synchronize(self, device: torch.device) -> None:
        return None
