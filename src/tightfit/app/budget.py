"""What ``tightfit run --budget`` adds to a run (private): the plan made for the run's own
inputs, and what its prediction covers (``--allow`` is :meth:`tightfit.fitting.Allow.parse`).

A plan is made for one forward. An encoder's run is that forward (plus pooling), so the
plan's peak is the prediction. A generation is the prefill forward over the prompt, then
one-token forwards whose KV cache grows with every token: the plan is made for the prefill
and for the last decode step, traced at the longest context (``fit(..., decode=...)``),
whose peak holds the whole cache where the prefill's activations are gone; the plan's
peak is the larger, so that the whole generation stays within the budget.

When nothing fits, the error is said again for the run (:func:`no_fit_message`): the
budget as the user gave it, what the planner could reach with what was allowed, and
only suggestions the caller can act on (a budget that fits, typed as a size; a wider
``--allow``), named as the caller writes them (:mod:`tightfit.app.spelling`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tightfit import backends
from tightfit._files import read_json
from tightfit._format import human_bytes
from tightfit.app.spelling import assigned, option
from tightfit.backends.cpu import read_process_memory, reset_process_peak
from tightfit.backends.resolve import ResolvedBackend
from tightfit.fitting import PLACEMENTS, Allow, FitError, FitPlan, fit, storage_names
from tightfit.fitting.traced import DecodeTrace
from tightfit.loading.stream import on_meta
from tightfit.memory import LiveTensorBytes

__all__: list[str] = []


@dataclass(frozen=True)
class Budgeted:
    """A plan for a run and what its prediction covers (``covers``, in words); ``context``:
    the positions a causal LM's KV cache is planned for, ``kv_format`` its format
    (:mod:`tightfit.app.kv_cache`; None for an encoder)."""

    plan: FitPlan
    covers: str
    context: int | None = None
    kv_format: str | None = None

    @property
    def kv_cache_bytes(self) -> int:
        """A generation's KV cache at the longest context planned (0 for an encoder)."""
        return self.plan.kv_cache.get("bytes", 0)

    @property
    def predicted_peak_bytes(self) -> int:
        return self.plan.predicted_peak_bytes


def plan_run(
    model: Any,
    example_inputs: dict,
    budget_bytes: int,
    *,
    backend: ResolvedBackend,
    allow: Allow | None,
    covers: str,
    decode: DecodeTrace | None = None,
    loading: bool = False,
    stored_dtypes: dict[str, torch.dtype] | None = None,
    max_error: float | None = None,
    decode_steps: int = 0,
    units: str = "layers",
) -> Budgeted:
    """Fit ``model`` for ``example_inputs`` (the forward the run makes, a generation's
    prefill) and ``decode`` (a generation's last decode step; None for an encoder) on the
    run's ``backend`` (resolved once, by the run) into ``budget_bytes``; ``fit`` raises
    FitError when nothing fits. The run is eager, where region
    hints save nothing, so the planner may not add them. ``loading``: ``model`` is a
    skeleton on meta whose checkpoint will stream into the plan; the inputs go to meta too;
    ``stored_dtypes``: the dtypes its checkpoint's headers give its tensors
    (:func:`tightfit.loading.stored_dtypes`), for a plan that counts their conversion;
    ``max_error``: ``fit``'s bound on the plan's expected error (None: its default);
    ``decode_steps``: the one-token forwards after ``example_inputs``' (a causal LM's
    decode), which the plan's time counts beside it; ``units``: ``fit``'s."""
    kv_cache_bytes = decode.kv_cache_bytes if decode is not None else 0
    if kv_cache_bytes >= budget_bytes:
        raise ValueError(
            f"{assigned('budget', budget_bytes)} ({human_bytes(budget_bytes)}) leaves nothing for the model: the KV "
            f"cache at {decode.context:,} positions alone needs {human_bytes(kv_cache_bytes)} ({kv_cache_bytes:,} B); "
            f"give a shorter prompt, a smaller {option('max_new_tokens')} or a larger {option('budget')}"
        )
    try:
        plan = fit(
            model,
            on_meta(example_inputs) if loading else example_inputs,
            budget_bytes,
            backend=backend,
            allow=replace(allow or Allow(), hints=False),
            loading=loading,
            stored_dtypes=stored_dtypes,
            max_error=max_error,
            decode_steps=decode_steps,
            units=units,
            decode=decode,
        )
    except FitError as error:
        if error.smallest_peak_bytes <= budget_bytes:  # the budget fits, the error bound does not: said as it is
            raise
        smallest = error.smallest_peak_bytes
        raise FitError(
            no_fit_message(
                budget_bytes, smallest, error.parts, device=backend.device, allow=allow, kv_cache_bytes=kv_cache_bytes
            ),
            budget_bytes=budget_bytes,
            smallest_peak_bytes=smallest,
            parts=error.parts,
        ) from None
    return Budgeted(plan, covers)


def read_plan(file: str | Path) -> FitPlan:
    """The plan in ``file``: ``tightfit fit --json``'s output (the plan under ``"plan"``) or
    ``FitPlan.to_json()``'s; a ValueError naming the file where it is neither."""
    if not isinstance(file, (str, Path)):
        raise TypeError(f"plan must be a FitPlan or a file path, got {type(file).__name__}: {file!r}")
    data = read_json(file)
    if isinstance(data, dict) and "format" not in data and isinstance(data.get("plan"), dict):
        data = data["plan"]  # tightfit fit --json: the plan and what it covers
    try:
        return FitPlan.from_json(json.dumps(data))
    except ValueError as error:
        raise ValueError(f"{file} holds no tightfit plan ({error}); write one with tightfit fit --json") from None


def size_at_least(nbytes: int) -> str:
    """The shortest size string (decimal units, one decimal) of at least ``nbytes``:
    ``1636736`` -> ``'1.7MB'``; what a suggestion of a budget reads."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{math.ceil(nbytes * 10 / scale) / 10:g}{unit}"
    return str(nbytes)


def allow_text(allow: Allow | None) -> str | None:
    """``allow`` as ``--allow`` names it (``'keep,float8,disk'``: only the restricted
    kinds), or None where it restricts nothing the run could use."""
    if allow is None:
        return None
    names = []
    if allow.storage != frozenset(storage_names()):
        names += [name for name in storage_names() if name in allow.storage]
    if allow.placement != frozenset(PLACEMENTS):
        names += [name for name in PLACEMENTS if name in allow.placement]
    return ",".join(names) or None


def no_fit_message(
    budget_bytes: int,
    smallest_peak_bytes: int,
    parts: list[tuple[str, int]],
    *,
    device: torch.device,
    allow: Allow | None,
    kv_cache_bytes: int = 0,
) -> str:
    """Why a run's budget cannot be met, and what would meet it, for the run's caller:
    the least budget that fits as a size to type, a wider allow where it was restricted.
    ``parts``: the planner's (what, bytes) of its smallest peak, largest first."""
    restricted = allow_text(allow)
    reach = f"with {assigned('allow', restricted)}" if restricted else "with every storage and placement"
    listed = "; ".join(f"{what}: {human_bytes(size)}" for what, size in parts[:4])
    message = f"{assigned('budget', budget_bytes)} ({human_bytes(budget_bytes)}) cannot be met on {device}"
    if kv_cache_bytes:
        message += f", {human_bytes(kv_cache_bytes)} of it for the KV cache at the last decode step"
    message += (
        f": the smallest peak the planner reaches {reach} is {human_bytes(smallest_peak_bytes)} "
        f"({smallest_peak_bytes:,} B), dominated by {parts[0][0]}. Largest parts: {listed}. "
    )
    if parts[0][0].startswith("activations"):
        message += (
            "No storage or placement shrinks the activations, and the run is eager, so slicing the layer stack "
            "(compiled DFS hints, docs/hints.md) would not either. "
        )
    message += f"Give {assigned('budget', size_at_least(smallest_peak_bytes))} or more"
    if restricted:
        message += f", or allow more than {assigned('allow', restricted)}"
    return message


@dataclass(frozen=True)
class Loaded:
    """A model streamed into its plan, and what loading it took: ``peak_bytes`` on the
    device (live tensors on the CPU, the allocator's peak on an accelerator) and the
    process's peak RSS while loading (None where it cannot be reset)."""

    model: Any
    seconds: float
    peak_bytes: int
    peak_rss_bytes: int | None


def measure_load(load: Callable[[], Any], device: torch.device) -> Loaded:
    """Run ``load()`` once, timed, with its peak memory on ``device``."""
    backend = backends.get(device)
    rss_reset = reset_process_peak()
    start = time.perf_counter()
    if device.type == "cpu":
        with LiveTensorBytes("cpu") as tracker:
            model = load()
        peak = tracker.peak
    else:
        backend.reset_peak_memory(device)
        model = load()
        backend.synchronize(device)
        peak = backend.memory(device).peak
    seconds = time.perf_counter() - start
    return Loaded(model, seconds, peak, read_process_memory()[1] if rss_reset else None)
