"""Measuring memory honestly (see the design): accelerators report their allocator's
peak; on the CPU torch keeps no statistics, so tightfit counts the bytes of live tensor
storages itself and also reads the process's peak resident set size."""

from __future__ import annotations

import statistics
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
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = storage.nbytes()  # identity of the storage, also for meta tensors
    return sum(seen.values())


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of storages on one device type created while the mode is active.

    ``current`` is what is still alive now and ``peak`` the most seen alive at once,
    sampled after every aten op. Storages that existed before entry (weights) are not
    counted, even when a view or an in-place op returns them: add them yourself, or pass
    them as ``existing``: those count from the start until they are freed (weights that
    a hook replaces during the run).
    """

    def __init__(self, device_type: str = "cpu", existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        if not isinstance(device_type, str) or not device_type:
            raise ValueError(f"device_type must be a non-empty str, got {device_type!r}")
        self.device_type = device_type
        self._live: dict[StorageWeakRef, int] = {}
        self._foreign: set[StorageWeakRef] = set()  # seen first as an input: existed before entry
        for tensor in existing:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"existing must hold tensors, got {type(tensor).__name__}")
            if tensor.device.type == device_type:
                storage = tensor.untyped_storage()
                self._live[StorageWeakRef(storage)] = storage.nbytes()
        self.current = sum(self._live.values())
        self.peak = self.current

    def _storages(self, tree: Any) -> list[torch.UntypedStorage]:
        return [
            leaf.untyped_storage()
            for leaf in tree_flatten(tree)[0]
            if isinstance(leaf, torch.Tensor) and leaf.device.type == self.device_type
        ]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for storage in self._storages((args, kwargs)):
            ref = StorageWeakRef(storage)
            if ref not in self._live:
                self._foreign.add(ref)
        result = func(*args, **(kwargs or {}))
        for ref in [ref for ref in self._live if ref.expired()]:
            self.current -= self._live.pop(ref)
        self._foreign = {ref for ref in self._foreign if not ref.expired()}
        for storage in self._storages(result):
            ref = StorageWeakRef(storage)
            if ref not in self._live and ref not in self._foreign:
                self._live[ref] = storage.nbytes()
                self.current += self._live[ref]
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
        return statistics.median(self.seconds)


def measure(fn: Callable[[], Any], device: torch.device | str, *, repeat: int = 5, warmup: int = 1, baseline_bytes: int = 0) -> Measurement:
    """Time ``fn`` ``repeat`` times after ``warmup`` calls, then record its peak memory.

    Timing runs untracked; on the CPU one more call runs under :class:`LiveTensorBytes`,
    whose per-op bookkeeping would otherwise inflate the latency.
    """
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 0), ("baseline_bytes", baseline_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    backend = get(device)
    device = backend.resolve_device(device)
    for _ in range(warmup):
        fn()
    backend.synchronize(device)
    if device.type != "cpu":
        backend.reset_peak_memory(device)
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        backend.synchronize(device)
        seconds.append(time.perf_counter() - start)
    if device.type != "cpu":
        info = backend.memory(device)
        return Measurement(str(device), seconds, baseline_bytes, info.peak, None, info.source)
    rss_reset = reset_process_peak()
    with LiveTensorBytes("cpu") as tracker:
        fn()
    peak_rss = read_process_memory()[1] if rss_reset else None  # without a reset it is the lifetime peak
    return Measurement(str(device), seconds, baseline_bytes, baseline_bytes + tracker.peak, peak_rss,
                       "live tensors: weights + created by the run")
