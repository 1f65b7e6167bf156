"""Measuring what the compile backend's programs allocate on the CPU, to set against a plan.

``tightfit.memory.LiveTensorBytes`` is a dispatch mode. Entered before a compiled call,
it makes dynamo run the frame eagerly, so it is entered when the first split starts.
aot_autograd's forward restores the dispatch keys when it returns, which leaves the mode
on the stack but asleep (the backward would go unseen): at every later split start a
sleeping tracker is re-entered, keeping what it counted. Allocations made between
programs by autograd itself (the gradient seed) are not seen; a plan counts those as
inputs anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tightfit.graph.execution import observe_splits
from tightfit.memory import LiveTensorBytes

__all__ = ["compiled_peak"]


def _awake() -> bool:
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python)


def compiled_peak(fn: Callable[[], Any], device_type: str = "cpu") -> int:
    """Peak bytes of the tensors created on ``device_type`` from the first split ``fn`` runs to its return."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}")
    tracker = LiveTensorBytes(device_type)
    entered: list[bool] = []

    def observe(event: str, split: Any) -> None:
        if event != "start":
            return
        if not entered:
            tracker.__enter__()
            entered.append(True)
        elif not _awake():
            tracker.__exit__(None, None, None)
            tracker.__enter__()

    try:
        with observe_splits(observe):
            fn()
    finally:
        if entered:
            tracker.__exit__(None, None, None)
    if not entered:
        raise RuntimeError("fn ran no split of the tightfit compile backend (was it compiled with backend='tightfit'?)")
    return tracker.peak
