"""``tightfit.fit``: given a model, example inputs and a memory budget, choose per unit
how its weights are stored and where they live, so that the predicted device peak is
within the budget at the least predicted time. See docs/fit.md."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tightfit._format import human_bytes
from tightfit._validate import check_choice, check_count, check_type
from tightfit.fitting.allow import Allow
from tightfit.fitting.calibration import Calibration, figures_of
from tightfit.fitting.options import UNIT_SIZES, Option, Unit, find_units, layer_names, options_for, with_decode
from tightfit.fitting.outliers import ASSUMED_OUTLIER_FRACTION, observe_outliers
from tightfit.fitting.plan import FitPlan, PlanEntry, check_reserved
from tightfit.fitting.quality import DEFAULT_MAX_ERROR, expected_error, parse_error, percent
from tightfit.fitting.regions import Sliced, slice_layers
from tightfit.fitting.search import Choice, peak_of, search
from tightfit.fitting.size import parse_size
from tightfit.fitting.traced import DECODE, DecodeTrace, Traced, trace_decode, trace_forward
from tightfit.fitting.training import fit_training
from tightfit.fitting.training_plan import TrainingPlan
from tightfit.quant import storage_formats

__all__ = ["FitError", "fit"]


class FitError(ValueError):
    """No plan meets the budget. ``smallest_peak_bytes``: the least predicted peak that
    ``allow`` reaches; ``parts``: (what, bytes) of that peak, largest first."""

    def __init__(
        self, message: str, *, budget_bytes: int, smallest_peak_bytes: int, parts: list[tuple[str, int]]
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest_peak_bytes
        self.parts = parts


def _split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword inputs: a tensor, a tuple or list of tensors, or a dict of
    keyword tensors; every value must be a tensor."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        for key, value in example_inputs.items():
            check_type("example_inputs key", key, str)
            check_type(f"example_inputs[{key!r}]", value, torch.Tensor)
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        for index, value in enumerate(example_inputs):
            check_type(f"example_inputs[{index}]", value, torch.Tensor)
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tuple or list of tensors, a dict of keyword tensors or a tensor, "
        f"got {type(example_inputs).__name__}"
    )


def _disk_reads(units: list[Unit], figures: Calibration, backend: Any, device: torch.device) -> tuple[bool, str]:
    """Whether the CPU's page cache will hold what a plan maps from disk, and the time
    model's assumption in words: it will where the whole model fits in the memory the host
    has available now (then a mapped unit reads at the figures' ``cached_read_bandwidth``,
    measured on pages the cache holds); else every read is priced at ``disk_bandwidth``."""
    if device.type != "cpu":
        return False, f"from disk at {figures.disk_bandwidth / 1e9:.2f} GB/s, then copied to {device}"
    model = sum(unit.bytes for unit in units)
    available = backend.memory(device).free
    if figures.cached_read_bandwidth is None or available is None or model > available:
        why = (
            "no page-cache read figure in the calibration"
            if figures.cached_read_bandwidth is None
            else f"the model's {human_bytes(model)} may not stay in the page cache "
            f"({'unknown' if available is None else human_bytes(available)} available)"
        )
        return False, f"from disk at {figures.disk_bandwidth / 1e9:.2f} GB/s each forward: {why}"
    return True, (
        f"from the page cache at {figures.cached_read_bandwidth / 1e9:.1f} GB/s: the model's {human_bytes(model)} "
        f"fit in the {human_bytes(available)} of memory available when planned"
    )


def _phase_peaks(
    phase_options: dict[str, list[list[Option]]],
    picks: tuple[int, ...],
    prefill: Traced,
    last_step: Traced | None,
    reserved_bytes: int,
) -> dict[str, int]:
    """The chosen plan's predicted peak in each phase (the prefill, the last decode step):
    the weights held, that phase's activations or a unit decoding in it, the onloaded
    copies, what is reserved; {} without a traced decode step."""
    if last_step is None:
        return {}
    peaks = {}
    for phase, traced in (("prefill", prefill), (DECODE, last_step)):
        choice = peak_of(phase_options[phase], picks, traced.activation_bytes)
        peaks[phase] = choice.held_bytes + choice.compute_bytes + choice.onload_bytes + reserved_bytes
    return peaks


def _why(unit: Unit, option: Option, keep: Option, applies_nothing: bool) -> str:
    if unit.fixed:
        return f"kept: {unit.fixed}"
    if option.storage == "keep" and option.placement == "device":
        return "the budget covers the unchanged model" if applies_nothing else "kept: fastest, and the budget has room"
    where = {"device": "", "cpu": ", weights in CPU memory", "disk": ", weights memory-mapped from disk"}[
        option.placement
    ]
    if option.placement == "disk" and option.storage == "keep" and unit.converted:
        where = ", weights converted from the checkpoint's dtype into an offload file on disk"
    saved = keep.held_bytes - option.held_bytes
    extra = (option.seconds - keep.seconds) * 1e3
    return f"{option.storage}{where}: {human_bytes(saved)} less on the device, {extra:+.2f} ms"


def _parts(
    units: list[Unit], options: list[list[Option]], choice: Choice, activations: int, peak_node: str | None
) -> list[tuple[str, int]]:
    parts = [(f"activations and inputs (peak at node {peak_node})", activations)]
    for unit, unit_options, pick in zip(units, options, choice.picks):
        option = unit_options[pick]
        if option.held_bytes:
            parts.append((f"weights of {unit.name} ({option.storage} on the {option.placement})", option.held_bytes))
    if choice.load_bytes > choice.compute_bytes:
        parts[0] = ("the largest unit while it streams in and converts (more than the activations)", choice.load_bytes)
    elif choice.compute_bytes > activations:
        parts.append(("decoded weights while their unit computes", choice.compute_bytes - activations))
    if choice.onload_bytes:
        parts.append(("copies of offloaded units onloaded for their forward", choice.onload_bytes))
    return sorted(parts, key=lambda part: -part[1])


def _slicing_note(
    parts: list[tuple[str, int]],
    activations: int,
    allowed: Allow,
    layers: list[str],
    tried: tuple[int, ...],
    refused: str,
) -> str:
    if parts[0][1] != activations:
        return ""
    if not allowed.hints:
        why = "allow hints=True lets fit add them" if layers else "the model has no layer stack for fit to hint"
    elif not layers:
        why = "the model has no layer stack for fit to hint"
    elif refused:
        why = f"fit did not add them: {refused}"
    else:
        why = (
            f"fit tried {', '.join(map(str, tried))} slices of the layer stack over dimension 0 with every unit kept "
            f"on the device (hints are not combined with quantization or offloading), and none reached the budget"
        )
    return (
        ". Activations dominate: running that region slice by slice (tightfit.hint(schedule='dfs', slices=N) under "
        f"torch.compile(backend='tightfit'), docs/hints.md) can cut them; {why}"
    )


def fit(
    model: nn.Module,
    example_inputs: Any,
    budget: int | str,
    *,
    backend: Any = None,
    allow: Allow | Mapping[str, Any] | None = None,
    calibration: Calibration | None = None,
    remeasure: bool = False,
    loading: bool = False,
    stored_dtypes: Mapping[str, torch.dtype] | None = None,
    reserve: Mapping[str, int] | None = None,
    reserve_loading: Mapping[str, int] | None = None,
    max_error: float | str | None = None,
    decode_steps: int = 0,
    units: str = "layers",
    decode: DecodeTrace | None = None,
    training: bool = False,
    optimizer: str = "AdamW",
) -> FitPlan | TrainingPlan:
    """A :class:`FitPlan` whose predicted device peak for ``model(*example_inputs)`` (or
    ``model(**example_inputs)`` for a dict) is within ``budget`` at the least predicted time.

    ``budget``: bytes, as an int or a size string (``"40MB"``, ``"1.5GiB"``); ``backend``:
    a backend name, device or Backend (default: the default backend); ``allow``: the
    storages and placements the planner may use, and whether it may add region hints
    (:class:`Allow` or a dict with keys ``storage``, ``placement`` and ``hints``); ``calibration``: the time model's figures (default:
    measured once per device and cached; ``remeasure`` measures again). Raises
    :class:`FitError` when nothing allowed fits, naming the smallest peak reachable and
    what dominates it. ``example_inputs``: a tensor, a tuple or list of tensors (positional
    inputs) or a dict of keyword tensors.

    The model is not changed: call ``plan.apply(model)``. Planning traces the model with
    fake tensors; only when the budget needs more than keeping the model as it is and
    a storage whose transient bytes depend on the data (int8: LLM.int8()'s outlier columns)
    is allowed, it runs one real forward of the example inputs under
    ``torch.inference_mode`` (in eval mode, every module's training flag restored after)
    to count the outlier columns; if that forward runs out of memory, the
    planner assumes a bound instead and says so in ``plan.int8_outliers``.

    Region hints: when no choice of storages and placements meets the budget, the model
    has a layer stack and ``allow`` permits hints, the planner keeps every unit as it is
    on the device and slices each layer over dimension 0 of its input (the batch):
    ``tightfit.hint(schedule="dfs", slices=N, slice_dim=0)`` with the fewest N of 2, 4,
    8, ... whose peak, predicted by ``plan_memory(runtime="compiled")`` with the hints
    under strict mode (a region the slicing proof refuses is not counted), is within
    the budget. Such a plan has ``plan.hints`` and ``plan.runtime == "compiled"``: its
    peak holds only for ``plan.compile(model)``, not for eager calls.

    ``loading``: the plan also covers streaming the weights in from a checkpoint
    (:func:`tightfit.load`): on the CPU, each unit's tensors as read and its conversion
    count above the weights held, so the budget holds from the first byte read. Plan
    such a model on the meta device (it needs no weights). ``stored_dtypes`` (with
    ``loading`` only): the dtype the checkpoint stores each tensor in, by the model's
    qualified names (:func:`tightfit.loading.stored_dtypes` reads them from the safetensors
    headers); a tensor stored in another dtype than the model's is read and converted
    while loading, so its unit is not mapped from the checkpoint in place: kept on disk,
    it is converted and written to an offload file (default: every tensor is stored in
    the model's dtype).

    ``reserve``: bytes the run will hold on the device besides the weights and this
    forward, by what they are for (``{"KV cache growth to 2,048 tokens": n}``): the units
    are fitted into the budget less their sum, and the plan keeps them as
    ``plan.reserved``, counted in its peaks and shown in its table, JSON and errors.
    ``reserve_loading`` (with ``loading`` only): bytes held on the device only while the
    checkpoint streams in (checking a unit's stored entries), by what they are for: counted
    in the load's peak above each unit as it loads, not in the run's, kept as
    ``plan.reserved_loading``.

    ``max_error``: the most expected error the plan may take to meet the budget (a
    fraction, or a percentage string ``"3%"``; :mod:`tightfit.fitting.quality`): among the
    plans within the budget and the bound, the fastest. FitError when none is within both.
    None: the default bound (3%), which gives way where the budget needs more, to the most
    precise plan within it, said in ``plan.quality``.

    ``decode_steps``: one-token forwards that follow the one traced (a causal LM's decode
    after its prefill): the time the planner minimizes is the traced forward's plus this
    many one-token forwards', each priced with the one-token figures (memory-bound: the
    bytes a weight reads count, not its rows), so prefill and decode are priced apart.

    ``units``: what the planner decides for, per layer of the stack: the whole layer
    (``"layers"``), or each of its blocks (``"blocks"``: its attention, its feed-forward
    network, and in a mixture of experts each expert, its router and shared parts apart),
    so that a layer may keep its attention on the device and move its feed-forward weights
    off, or a MoE layer keep its shared parts and move its experts.

    ``decode``: a generation's last one-token forward at its longest context
    (:class:`~tightfit.fitting.traced.DecodeTrace`; needs ``decode_steps``), traced too: the
    plan's peak is the larger of the traced forward's (the prefill) and that step's, where
    the KV cache is largest and the prefill's activations are gone, each with the weights
    and what the units decode and onload (and, ``loading``, the load's where it is larger);
    ``plan.phase_peaks`` gives both phases'.
    """
    check_type("model", model, nn.Module)
    args, kwargs = _split_inputs(example_inputs)
    if isinstance(budget, Mapping):
        raise TypeError(
            f"budget={budget!r} gives a budget per device; fit plans one device. A model across devices is cut into "
            f"stages, one per device: tightfit.distributed.plan_stages(folder, budget, inputs), run with "
            f"tightfit.distributed.run_local (docs/distributed.md)"
        )
    budget_bytes = parse_size(budget, "budget")
    check_type("training", training, bool)
    if not training and optimizer != "AdamW":
        raise ValueError(f"optimizer={optimizer!r} sizes a training step's state; it is taken only with training=True")
    if training:
        given = dict(
            loading=loading,
            stored_dtypes=stored_dtypes,
            reserve=reserve,
            reserve_loading=reserve_loading,
            max_error=max_error,
            decode_steps=decode_steps,
            decode=decode,
        )
        defaults = dict(loading=False, decode_steps=0)
        inference_only = [name for name, value in given.items() if value != defaults.get(name)]
        if units != "layers":
            inference_only.append("units")
        if inference_only:
            raise ValueError(
                f"training=True plans a training step; {', '.join(inference_only)} "
                f"{'is an option' if len(inference_only) == 1 else 'are options'} of an inference plan only"
            )
        allowed = Allow.coerce(allow)
        resolved, figures = _resolved_figures(backend, calibration, remeasure)
        return fit_training(
            model,
            args,
            kwargs,
            budget_bytes,
            resolved=resolved,
            figures=figures,
            allowed=allowed,
            optimizer=optimizer,
            fit_error=FitError,
        )
    reserved = check_reserved("reserve", dict(reserve) if isinstance(reserve, Mapping) else reserve or {})
    reserved_loading = check_reserved(
        "reserve_loading", dict(reserve_loading) if isinstance(reserve_loading, Mapping) else reserve_loading or {}
    )
    if reserved_loading and loading is not True:
        raise ValueError("reserve_loading (bytes held while the checkpoint streams in) needs loading=True")
    reserved_bytes, loading_bytes = sum(reserved.values()), sum(reserved_loading.values())
    if reserved_bytes + loading_bytes >= budget_bytes:
        every = {**reserved, **reserved_loading}
        listed = "; ".join(f"{what}: {human_bytes(size)}" for what, size in every.items())
        raise FitError(
            f"budget={human_bytes(budget_bytes)} ({budget_bytes} B) cannot be met: what is reserved besides the "
            f"weights takes {human_bytes(reserved_bytes + loading_bytes)} ({reserved_bytes + loading_bytes} B) of "
            f"it ({listed})",
            budget_bytes=budget_bytes,
            smallest_peak_bytes=reserved_bytes + loading_bytes,
            parts=sorted(every.items(), key=lambda part: -part[1]),
        )
    units_budget = budget_bytes - reserved_bytes
    bound = DEFAULT_MAX_ERROR if max_error is None else parse_error(max_error)
    check_count("decode_steps", decode_steps)
    if decode is not None:
        check_type("decode", decode, DecodeTrace)
        if not decode_steps:
            raise ValueError("decode (the last decode step, traced) needs decode_steps >= 1: the one-token forwards")
    check_choice("units", units, UNIT_SIZES)
    unit_size = units  # the name is the list of units below
    allowed = Allow.coerce(allow)
    check_type("loading", loading, bool)
    if stored_dtypes is not None:
        _check_stored_dtypes(stored_dtypes, loading)
    resolved, figures = _resolved_figures(backend, calibration, remeasure)
    backends, device = resolved
    prefill, leaves = trace_forward(model, args, kwargs, resolved)
    rows, call_rows = leaves.rows, leaves.call_rows
    last_step = trace_decode(model, decode, device) if decode is not None else None
    activations, peak_node = prefill.activation_bytes, prefill.peak_node
    if last_step is not None and last_step.activation_bytes > activations:
        activations = last_step.activation_bytes
        peak_node = (
            f"{last_step.peak_node} of the last decode step, its KV cache of {human_bytes(decode.kv_cache_bytes)} at "
            f"{decode.context:,} positions among them"
        )
    units = find_units(model, stored_dtypes, unit_size)
    weights = sum(math.prod(shape) for unit in units for name, _, shape, _ in unit.weights if name not in unit.tied)
    max_energy = bound**2 * weights

    one_row = dict.fromkeys(rows, 1)  # a decode step: one token through every leaf
    page_cached, disk_reads = _disk_reads(units, figures, backends[0], device)

    def build(outliers: dict[str, int] | None) -> tuple[list[list[Option]], dict[str, list[list[Option]]]]:
        """Each unit's options for the whole run, and (with a traced decode step) for the
        prefill alone and the last decode step alone, whose peaks the plan reports apart."""
        settings = dict(
            storages=allowed.storage,
            placements=allowed.placement,
            device=device,
            figures=figures,
            outliers=outliers,
            loading=loading,
            page_cached=page_cached,
        )
        built: list[list[Option]] = []
        phases: dict[str, list[list[Option]]] = {"prefill": [], DECODE: []}
        for unit in units:
            first = options_for(unit, rows=rows, call_rows=call_rows, live=prefill.live, **settings)
            phases["prefill"].append(first)
            if decode_steps:
                step_live = last_step.live if last_step is not None else prefill.live
                one = options_for(unit, rows=one_row, call_rows=one_row, one_token=True, live=step_live, **settings)
                phases[DECODE].append(one)
                first = [with_decode(p, d, decode_steps) for p, d in zip(first, one)]
            built.append(first)
        return built, phases if last_step is not None else {}

    options, phase_options = build(None)
    outliers, not_observed = None, ""
    sliced: Sliced | None = None  # DFS hints, chosen only when no storage or placement meets the budget
    tried: tuple[int, ...] = ()
    refused = ""
    keep = [
        next(i for i, o in enumerate(unit_options) if o.storage == "keep" and o.placement == "device")
        for unit_options in options
    ]
    full = peak_of(options, tuple(keep), activations, loading_bytes)
    full_peak = full.peak_bytes
    applies_nothing = full_peak <= units_budget
    forced = False
    if applies_nothing:
        choice = full
    else:
        thresholds = [
            f.outlier_threshold
            for f in storage_formats()
            if f.name in allowed.storage and f.outlier_threshold is not None
        ]
        if thresholds:  # only these storages' options depend on the data; a real forward when it can run
            outliers, not_observed = _observe(model, args, kwargs, device, min(thresholds))
            options, phase_options = build(outliers) if outliers is not None else (options, phase_options)
        found = search(options, units_budget, activations, max_energy, loading_bytes)
        choice, forced = found.best, found.forced
        if forced and max_error is not None and choice is not None:
            least = expected_error(choice.error_energy, weights)
            raise FitError(
                f"max_error={percent(bound)} cannot be met within budget={human_bytes(budget_bytes)} ({budget_bytes} B) "
                f"on {device}: the most precise plan within the budget has an expected error of {percent(least)}. "
                f"Give max_error={math.ceil(least * 1000) / 10:g}% or more, or a larger budget",
                budget_bytes=budget_bytes,
                smallest_peak_bytes=choice.peak_bytes + reserved_bytes,
                parts=_parts(units, options, choice, activations, peak_node),
            )
        layers = list(layer_names(model))
        if choice is None and allowed.hints and layers:
            sliced, tried, refused = slice_layers(
                model, args, kwargs, resolved, layers, str(device), units_budget - full.held_bytes
            )
            choice = full if sliced is not None else None
        if choice is None:
            smallest = found.smallest
            peak = smallest.peak_bytes + reserved_bytes
            parts = sorted(
                [
                    *_parts(units, options, smallest, activations, peak_node),
                    *reserved.items(),
                    *reserved_loading.items(),
                ],
                key=lambda p: -p[1],
            )
            listed = "; ".join(f"{what}: {human_bytes(size)}" for what, size in parts[:4])
            raise FitError(
                f"budget={human_bytes(budget_bytes)} ({budget_bytes} B) cannot be met on {device}: the smallest "
                f"predicted peak that allow={allowed.to_dict()} reaches is {human_bytes(peak)} ({peak} B)"
                f"{f', {human_bytes(reserved_bytes)} of it reserved besides the weights' if reserved else ''}"
                f"{f', {human_bytes(loading_bytes)} held while loading besides' if reserved_loading else ''}, "
                f"dominated by {parts[0][0]}. Largest parts: {listed}"
                f"{_slicing_note(parts, activations, allowed, layers, tried, refused)}",
                budget_bytes=budget_bytes,
                smallest_peak_bytes=peak,
                parts=parts,
            )
    entries = tuple(
        PlanEntry(
            module=unit.name,
            kind=unit.kind,
            storage=unit_options[pick].storage,
            placement=unit_options[pick].placement,
            bytes_before=unit.bytes,
            bytes_after=unit_options[pick].stored_bytes,
            held_bytes=unit_options[pick].held_bytes,
            seconds=unit_options[pick].seconds,
            why=_why(unit, unit_options[pick], unit_options[k], applies_nothing)
            if sliced is None or unit.name not in sliced.hints
            else f"kept; runs in {sliced.hints[unit.name]['slices']} slices over dimension 0 when compiled (DFS hint)",
            leaves=tuple(name for name, *_ in unit.weights),
        )
        for unit, unit_options, pick, k in zip(units, options, choice.picks, keep)
    )
    error = expected_error(choice.error_energy, weights)
    load_peak = choice.load_peak_bytes + reserved_bytes if loading else 0  # exact: the search bounds it
    running = choice.held_bytes + choice.compute_bytes + choice.onload_bytes
    transient = max(running + reserved_bytes, load_peak) - reserved_bytes - choice.held_bytes - activations
    if sliced is not None:  # the compiled plan of the hinted model replaces the eager activations
        activations, peak_node = sliced.activation_bytes, sliced.peak_node
    return FitPlan(
        model=type(model).__name__,
        backend=backends[0].name,
        device=str(device),
        budget_bytes=budget_bytes,
        predicted_peak_bytes=choice.held_bytes + activations + transient + reserved_bytes,
        predicted_weights_bytes=choice.held_bytes,
        predicted_activation_bytes=activations,
        predicted_transient_bytes=transient,
        predicted_seconds=choice.seconds,
        full_peak_bytes=full_peak + reserved_bytes,
        full_seconds=full.seconds,
        applies_nothing=applies_nothing,
        entries=entries,
        peak_node=peak_node,
        allow=allowed.to_dict(),
        calibration=figures.to_dict(),
        int8_outliers=_int8_outliers(entries, outliers, not_observed),
        hints=sliced.hints if sliced is not None else {},
        runtime="eager" if sliced is None else "compiled",
        covers_load=loading,
        predicted_load_peak_bytes=load_peak,
        reserved=reserved,
        reserved_loading=reserved_loading,
        decode_steps=decode_steps,
        phase_peaks=_phase_peaks(phase_options, choice.picks, prefill, last_step, reserved_bytes),
        kv_cache=decode.summary() if decode is not None else {},
        disk_reads=disk_reads if any(entry.placement == "disk" for entry in entries) else "",
        predicted_error=error,
        max_error=bound,
        quality=_quality(error, bound, max_error is None, forced),
    )


def _quality(error: float, bound: float, default: bool, forced: bool) -> str:
    """What the plan's expected error is, against its bound, in words."""
    said = f"expected error {percent(error)} (RMS over the weights of each layer output's relative error)"
    if forced:
        return (
            f"{said}, above the default bound of {percent(bound)}: no plan within the budget meets it, so this is the "
            f"most precise one that fits; give a larger budget, or max_error (--max-error) to accept it"
        )
    return f"{said}, within the {'default ' if default else ''}bound of {percent(bound)}"


def _check_stored_dtypes(stored_dtypes: Any, loading: bool) -> None:
    """A mapping of tensor names to dtypes, for a plan that covers loading."""
    check_type("stored_dtypes", stored_dtypes, Mapping)
    for name, dtype in stored_dtypes.items():
        check_type("stored_dtypes key", name, str)
        check_type(f"stored_dtypes[{name!r}]", dtype, torch.dtype)
    if not loading:
        raise ValueError("stored_dtypes describes a checkpoint to load; it is taken only with loading=True")


def _resolved_figures(backend: Any, calibration: Calibration | None, remeasure: bool) -> tuple[Any, Calibration]:
    """The backend resolved, and the time model's figures: ``calibration`` (checked to be
    of that backend), else measured once per device and cached (``remeasure``: again)."""
    from tightfit.backends.resolve import resolve_backend

    if calibration is not None:
        check_type("calibration", calibration, Calibration)
    check_type("remeasure", remeasure, bool)
    resolved = resolve_backend(backend)
    backends, device = resolved
    figures = calibration if calibration is not None else figures_of(backends[0], device, remeasure=remeasure)
    _check_calibration(figures, backends[0].name, device)
    return resolved, figures


def _check_calibration(figures: Calibration, backend: str, device: torch.device) -> None:
    """The figures must be of the backend the plan is for, with the figures its device needs."""
    if figures.backend != backend:
        raise ValueError(
            f"calibration is of backend {figures.backend!r} but the plan is for backend {backend!r} "
            f"({device}); pass calibrate({backend!r}) or figures measured with that backend"
        )
    if device.type != "cpu" and figures.host_to_device_bandwidth is None:
        raise ValueError(
            f"calibration has host_to_device_bandwidth=None, which a plan for {device} needs (offloaded "
            f"weights are copied onto the device); pass calibrate({backend!r}) or give that figure"
        )


def _is_out_of_memory(error: RuntimeError) -> bool:
    """An accelerator's out-of-memory error, or the CPU allocator's failure to allocate;
    other RuntimeErrors are real errors of the model or its inputs."""
    return isinstance(error, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error)


def _observe(
    model: nn.Module, args: tuple, kwargs: dict, device: torch.device, threshold: float
) -> tuple[dict[str, int] | None, str]:
    """The observed outlier columns at ``threshold`` (the least of the allowed storages':
    a column counted at it is counted at a higher one), or None and why they were not observed."""
    try:
        found = observe_outliers(model, args, kwargs, threshold)
    except RuntimeError as error:
        if not _is_out_of_memory(error):
            raise
        return None, f"the observing forward ran out of memory on {device}"
    if found is None:
        return None, "the model has meta tensors, or its tensors and the inputs are on different devices"
    return found, ""


def _int8_outliers(entries: tuple[PlanEntry, ...], outliers: dict[str, int] | None, not_observed: str = "") -> str:
    """What the predicted transient of the units stored with an outlier path (int8:
    LLM.int8()) assumes about it."""
    data_dependent = {f.name for f in storage_formats() if f.outlier_threshold is not None}
    if not any(e.storage in data_dependent for e in entries):
        return ""
    if outliers is None:
        why = not_observed or "the model has meta tensors, or its tensors and the inputs are on different devices"
        return f"assumed: up to {ASSUMED_OUTLIER_FRACTION:.1%} of each layer's input columns (not observed: {why})"
    leaves = [leaf for e in entries if e.storage in data_dependent for leaf in e.leaves]
    taking = sum(1 for leaf in leaves if outliers.get(leaf, 0))
    return f"observed in one real forward of the example inputs: {taking} of {len(leaves)} int8 layers take the outlier path"
