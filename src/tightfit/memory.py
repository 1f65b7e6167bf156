"""Measuring memory honestly (see the design): accelerators report their allocator's
peak; on the CPU torch keeps no statistics, so tightfit counts the bytes of live tensor
storages itself and also reads the process's peak resident set size."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tightfit.backends import get
from tightfit.backends.cpu import read_process_memory, reset_process_peak

__all__ = ["LiveTensorBytes", "Measurement", "measure", "tensor_bytes"]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and ties counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of storages on one device type created while the mode is active.

    ``current`` is what is still alive now and ``peak`` the most seen alive at once,
    sampled after every aten op. Tensors that existed before entry (weights) are not
    counted: add them yourself.
    """

    def __init__(self, device_type: str = "cpu") -> None:
        super().__init__()
        if not isinstance(device_type, str) or not device_type:
            raise ValueError(f"device_type must be a non-empty str, got {device_type!r}")
        self.device_type = device_type
        self._live: dict[StorageWeakRef, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for ref in [ref for ref in self._live if ref.expired()]:
            del self._live[ref]
        for leaf in tree_flatten(result)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device_type:
                storage = leaf.untyped_storage()
                self._live.setdefault(StorageWeakRef(storage), storage.nbytes())
        self.current = sum(self._live.values())
        self.peak = max(self.peak, self.current)
        return result


@dataclass(frozen=True)
class Measurement:
    """Seconds per call and peak memory of a measured callable on one device.

    ``peak_bytes`` is the accelerator allocator's peak, or on the CPU the peak bytes of
    live tensors created during the calls plus ``baseline_bytes`` (what existed before,
    such as weights). ``peak_rss_bytes`` is the process's peak RSS (CPU only).
    """

    device: str
    seconds: list[float]
    baseline_bytes: int
    peak_bytes: int | None
    peak_rss_bytes: int | None
    source: str

    @property
    def median_seconds(self) -> float:
        ordered = sorted(self.seconds)
        return ordered[len(ordered) // 2]


def measure(fn: Callable[[], Any], device: torch.device | str, *, repeat: int = 5, warmup: int = 1, baseline_bytes: int = 0) -> Measurement:
    """Time ``fn`` ``repeat`` times after ``warmup`` calls and record its peak memory."""
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 0), ("baseline_bytes", baseline_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    device = torch.device(device)
    backend = get(device)
    for _ in range(warmup):
        fn()
    backend.synchronize(device)
    seconds = []
    if device.type == "cpu":
        reset_process_peak()
        with LiveTensorBytes("cpu") as tracker:
            for _ in range(repeat):
                start = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - start)
        return Measurement(str(device), seconds, baseline_bytes, baseline_bytes + tracker.peak, read_process_memory()[1],
                           "live tensors: weights + created by the run")
    backend.reset_peak_memory(device)
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        backend.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return Measurement(str(device), seconds, baseline_bytes, backend.memory(device).peak, None, backend.memory(device).source)
