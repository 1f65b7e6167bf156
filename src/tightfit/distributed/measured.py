"""Timing and measuring a stage run on each device it uses, as a single run is measured
(live tensors on the CPU, the allocator's peak on an accelerator): one warm-up call,
``repeat`` timed calls, then one call measured on every device at once. Every rank makes
the same calls, so that the ranks stay in step."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tightfit import backends
from tightfit.backends.cpu import read_process_memory, reset_process_peak
from tightfit.memory.measure import LiveTensorBytes

__all__ = ["Timed", "timed_and_measured"]

_LIVE = "live tensors: weights + created by the run"


@dataclass(frozen=True)
class Timed:
    """What :func:`timed_and_measured` found: the measured call's ``result``, the median
    ``seconds`` of the timed calls, ``counted`` (``count()``'s growth per timed call: the
    seconds in sends and receives), per device its ``peaks`` and how each was measured,
    the process's ``peak_rss`` over the calls (None where it cannot be reset) and how many
    ``calls`` were made in all."""

    result: Any
    seconds: float
    counted: float
    peaks: dict[torch.device, int]
    measured_by: dict[torch.device, str]
    peak_rss: int | None
    calls: int


def timed_and_measured(
    call: Callable[[], Any],
    held: Mapping[torch.device, int],
    repeat: int,
    count: Callable[[], float],
    start_together: Callable[[], None] = lambda: None,
) -> Timed:
    """Time ``call`` and measure its peak on each device of ``held`` (device -> the bytes its
    weights hold there, what live tensors start from on the CPU). ``start_together`` runs
    before each timed call, untimed: the ranks' barrier, so that each call is one run's
    time from its start, not a run overlapping the ranks' previous one."""
    devices = list(held)
    rss_reset = reset_process_peak()
    call()  # the warm-up, which also opens a run's connections
    seconds: list[float] = []
    before = count()
    for _ in range(repeat):
        start_together()
        start = time.perf_counter()
        call()
        for device in devices:
            backends.get(device).synchronize(device)
        seconds.append(time.perf_counter() - start)
    counted = (count() - before) / repeat
    accelerators = [d for d in devices if d.type != "cpu"]
    for device in accelerators:
        backends.get(device).reset_peak_memory(device)
    on_cpu = any(d.type == "cpu" for d in devices)
    with LiveTensorBytes("cpu") if on_cpu else contextlib.nullcontext() as tracker:
        result = call()  # no earlier call's result is alive: the allocator's peak is this call's alone
    peaks, measured_by = {}, {}
    for device in devices:
        if device.type == "cpu":
            peaks[device], measured_by[device] = held[device] + tracker.peak, _LIVE
        else:
            backend = backends.get(device)
            backend.synchronize(device)
            info = backend.memory(device)
            peaks[device], measured_by[device] = info.peak, info.source
    peak_rss = read_process_memory()[1] if rss_reset else None
    return Timed(result, statistics.median(seconds), counted, peaks, measured_by, peak_rss, repeat + 2)
