"""Folders whose checkpoint holds quantized weights already: one that transformers saved
with a bitsandbytes ``quantization_config`` (4-bit nf4 or fp4, with or without double
quantization; 8-bit LLM.int8()), or one that :func:`tightfit.save` wrote beside its plan
(:data:`PLAN_FILE`).

The stored tensors go into tightfit's quantized modules as they are: nothing is
dequantized or quantized again. Which leaves are quantized, and how, is read from the
checkpoint's entries (a leaf's ``weight.quant_state.bitsandbytes__nf4``, ``SCB``, ...)
and must agree with what the config's ``quantization_config`` or the plan says; each
quantized leaf's entries are then checked together by its module's own
``load_state_dict`` (D9). A leaf stored plainly (one transformers skipped: ``lm_head``,
``llm_int8_skip_modules``) stays as it is. Private to ``tightfit.loading``: the way in
is :func:`tightfit.load`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit._files import read_text
from tightfit._progress import muted, task
from tightfit._validate import check_type
from tightfit.fitting import Allow, Calibration, FitPlan, fit, parse_size
from tightfit.fitting.execute import PlanExecutor
from tightfit.fitting.outliers import assumed_outliers
from tightfit.fitting.plan import PlanEntry
from tightfit.hooks import ModuleHook
from tightfit.hooks.registry import HookRegistry
from tightfit.loading.folder import checkpoint_dtype, model_kind, read_json, skeleton
from tightfit.loading.safetensors import Checkpoint
from tightfit.loading.stored import (
    COMPUTE_DTYPE,
    MODULES,
    PLAN_FILE,
    STATE_KEYS,
    StoredLeaf,
    bitsandbytes_settings,
    check_bitsandbytes,
    check_planned,
    stored_layout,
    swap_modules,
)
from tightfit.loading.stream import (
    _check_filled,
    _converts,
    _map_unit,
    _plan_device,
    _read_unit,
    _Slots,
    _sources,
    _stored_dtypes,
    _stream_entry,
    default_inputs,
    on_meta,
)
from tightfit.quant import FLOAT8_DTYPE, Linear4bit, LinearInt8, QuantState, StorageFormat, storage_format

__all__ = ["load_quantized"]

SCALES = "quantization scales, held on the device whatever the placement"
CHECKING = "checking one unit's quantized entries as it loads"


# -- planning ------------------------------------------------------------------------------


def _stored_tensors(leaf: StoredLeaf, checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The tensors ``leaf``'s module registers (weight, bias, SCB, weight_scale), on meta
    in their stored shapes and dtypes; its quant state's tensors are not registered."""
    names = [key.removeprefix(f"{leaf.base}.") for key in leaf.keys]
    registered = [name for name in names if not name.startswith("weight.") and name != "weight_format"]
    return {
        name: torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        for name in registered
        for entry in [checkpoint.entries[f"{leaf.base}.{name}"]]
    }


def _state_bytes(leaf: StoredLeaf, checkpoint: Checkpoint) -> int:
    """Bytes of ``leaf``'s quant state (scales, code tables, the double quantization's
    offset): held on the device wherever the leaf's unit is placed."""
    found = [f"{leaf.base}.{key}" for key in STATE_KEYS if f"{leaf.base}.{key}" in checkpoint.entries]
    nested_offset = 4 if f"{leaf.base}.weight.nested_absmax" in checkpoint.entries else 0
    return sum(checkpoint.entries[key].nbytes for key in found) + nested_offset


def _checking_bytes(leaf: StoredLeaf, checkpoint: Checkpoint) -> int:
    """Bytes alive above what ``leaf`` holds while its module checks its entries: those it
    does not keep (the packed JSON, ``weight_format``), and the scratch of the finiteness
    check of its largest float32 entry (``torch.isfinite`` allocates 1.75 times it)."""
    entries = {key.removeprefix(f"{leaf.base}."): checkpoint.entries[key] for key in leaf.keys}
    kept = ("weight", "bias", "SCB", "weight_scale", *STATE_KEYS)
    dropped = sum(entry.nbytes for name, entry in entries.items() if name not in kept)
    checked = [entry.nbytes for name, entry in entries.items() if entry.dtype == torch.float32 and name != "bias"]
    return dropped + 2 * max(checked, default=0)


class _StoredLinear(nn.Linear):
    """A quantized leaf while its folder is planned: the tensors its module registers, on
    meta in their stored shapes (the planner counts them as its unit's bytes), and a
    forward that allocates what the module's forward allocates above its output
    (:attr:`StorageFormat.transient_bytes`), which the fake-tensor trace counts. A
    subclass of ``nn.Linear``, so that outside the layer stack it is a unit of its own,
    and never a leaf the planner would convert (those are ``nn.Linear`` exactly)."""

    def __init__(
        self, linear: nn.Linear, tensors: dict[str, torch.Tensor], storage: StorageFormat, compute: torch.dtype | None
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        for name, tensor in {"bias": None, **tensors}.items():
            self.register_buffer(name, tensor)
        self.storage, self.compute, self.compute_dtype = storage, compute, compute or linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = x.dtype
        x = x.to(self.compute) if self.compute is not None else x  # as the hook that runs it in bnb_4bit_compute_dtype
        shape, rows = (self.out_features, self.in_features), x.numel() // self.in_features
        outliers = assumed_outliers(self.in_features) if self.storage.outlier_threshold is not None else 0
        scratch = x.new_empty(
            self.storage.transient_bytes(shape, rows, outliers, self.compute_dtype), dtype=torch.uint8
        )
        out = x.new_empty((*x.shape[:-1], self.out_features))
        del scratch
        return out.to(given)


def _plan(
    model: nn.Module,
    layout: dict[str, StoredLeaf],
    checkpoint: Checkpoint,
    inputs: Any,
    budget: int,
    backend: Any,
    allow: Allow | Mapping[str, Any] | None,
    calibration: Calibration | None,
    compute: torch.dtype | None,
    units: str = "layers",
) -> FitPlan:
    """Placements for the stored model within ``budget``: :func:`tightfit.fit` on the
    skeleton with a stand-in for each quantized leaf and only ``keep`` allowed (storages
    are the checkpoint's; ``allow`` picks placements and hints). The quant states, which
    stay on the device wherever their units go, are a reservation of the plan for the
    whole run; checking one unit's quantized entries, one for its load. The plan then
    names each unit's stored storage."""
    allowed = Allow.coerce(allow)
    quantized = [leaf for leaf in layout.values() if leaf.storage != "keep"]
    states = {leaf.name: _state_bytes(leaf, checkpoint) for leaf in quantized}
    checking = max((_checking_bytes(leaf, checkpoint) for leaf in quantized), default=0)
    modules = dict(model.named_modules())
    stand_ins = {
        leaf.name: _StoredLinear(
            modules[leaf.name],
            _stored_tensors(leaf, checkpoint),
            storage_format(leaf.storage),
            compute if leaf.storage in ("nf4", "fp4") else None,
        )
        for leaf in quantized
    }
    originals = swap_modules(model, stand_ins)
    try:
        plan = fit(
            model,
            inputs,
            budget,
            backend=backend,
            allow=Allow(storage=frozenset({"keep"}), placement=allowed.placement, hints=allowed.hints),
            calibration=calibration,
            loading=True,
            stored_dtypes=_stored_dtypes(model, checkpoint),  # a plain leaf stored in another dtype is converted
            reserve={SCALES: sum(states.values())} if quantized else None,
            reserve_loading={CHECKING: checking} if quantized else None,
            units=units,
        )
    finally:
        swap_modules(model, originals)
    planned = [entry.module for entry in plan.entries if entry.kind != "rest"]
    return replace(plan, entries=tuple(_described(entry, quantized, planned, states) for entry in plan.entries))


def _described(entry: PlanEntry, quantized: list[StoredLeaf], units: list[str], states: dict[str, int]) -> PlanEntry:
    """``entry`` naming the storage its leaves are stored in, their quant states counted in
    its stored bytes (the bytes it holds on the device leave them out: they are the plan's
    reservation :data:`SCALES`, held wherever the unit goes)."""

    def unit_of(name: str) -> str:
        return next((unit for unit in units if name == unit or name.startswith(f"{unit}.")), "")

    inside = [leaf for leaf in quantized if unit_of(leaf.name) == ("" if entry.kind == "rest" else entry.module)]
    if not inside:
        return entry
    storages = sorted({leaf.storage for leaf in inside})
    if len(storages) > 1:
        raise ValueError(
            f"unit {entry.module!r} holds leaves stored as {', '.join(storages)} ({inside[0].marker!r}, ...); "
            f"a plan names one storage per unit"
        )
    extra = sum(states[leaf.name] for leaf in inside)
    return replace(
        entry,
        storage=storages[0],
        leaves=tuple(leaf.name for leaf in inside),
        bytes_before=entry.bytes_before + extra,
        bytes_after=entry.bytes_after + extra,
        why=f"{storages[0]} in the checkpoint, read as stored; {entry.why}",
    )


# -- loading -------------------------------------------------------------------------------


class _ComputeIn(ModuleHook):
    """Runs a 4-bit layer in ``dtype``, as bitsandbytes' ``Linear4bit`` does with
    ``bnb_4bit_compute_dtype``: the input cast to it, the weight decoded straight into it
    (not rounded to its stored dtype first), the output cast back to the input's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def around(self, module: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        x, *rest = args
        stored = module.quant_state
        module.quant_state = replace(stored, dtype=self.dtype)
        try:
            return call(x.to(self.dtype), *rest, **kwargs).to(x.dtype)
        finally:
            module.quant_state = stored


def _shell(module: nn.Linear, leaf: StoredLeaf, checkpoint: Checkpoint, threshold: float) -> nn.Module:
    """The quantized module that ``leaf``'s entries load into: its registered tensors on
    meta in their stored shapes (read like any other), a placeholder quant state (the
    entries bring the real one)."""
    tensors = _stored_tensors(leaf, checkpoint)
    features = (module.in_features, module.out_features)
    if leaf.storage == "int8":
        return LinearInt8(*features, tensors["weight"], tensors["SCB"], module.bias, threshold)
    quant_type = None if leaf.storage == "8bit" else leaf.storage
    placeholder = QuantState(
        absmax=torch.empty(0, device="meta"),
        code=torch.empty(0, device="meta"),
        blocksize=64 if quant_type else 4096,
        dtype=module.weight.dtype,
        shape=(module.out_features, module.in_features),
        quant_type=quant_type,
    )
    return MODULES[leaf.storage](*features, tensors["weight"], placeholder, module.bias)


def _load_shell(module: nn.Module, leaf: StoredLeaf, checkpoint: Checkpoint, advance: Callable[[int], None]) -> None:
    """Load ``leaf``'s entries into its module, all checked together by the module: the
    tensors it registers as filled already (read, or mapped from the file), the rest read."""
    entries = {}
    for key in leaf.keys:
        name = key.removeprefix(f"{leaf.base}.")
        held = module._buffers.get(name, module._parameters.get(name))
        if held is None or held.is_meta:
            held = checkpoint.read(key)
            advance(held.nbytes)
        entries[name] = held
    try:
        result = module.load_state_dict(entries, strict=False, assign=True)
    except (ValueError, TypeError) as error:
        raise type(error)(f"checkpoint entries of {leaf.base!r}: {error}") from None
    wrong = [*result.missing_keys, *result.unexpected_keys]
    if wrong:
        raise ValueError(
            f"checkpoint entries of {leaf.base!r} do not make a {type(module).__name__}: "
            f"{'missing' if result.missing_keys else 'unexpected'} {leaf.base}.{wrong[0]}"
        )


def _fill_float8(module: nn.Module, leaf: StoredLeaf, checkpoint: Checkpoint, slots: _Slots, advance: Any) -> None:
    """Fill a float8 leaf's weight with its stored values upcast (float8 times its
    power-of-two row scale, exact in the weight's dtype); casting it again restores the
    same float8 values and scales."""
    weight, scale = (checkpoint.read(f"{leaf.base}.{name}") for name in ("weight", "weight_scale"))
    advance(weight.nbytes + scale.nbytes)
    meta = module.weight
    if weight.dtype != FLOAT8_DTYPE or weight.shape != meta.shape:
        raise ValueError(
            f"checkpoint entry {leaf.base}.weight is {weight.dtype} of shape {tuple(weight.shape)}; a float8 "
            f"{leaf.name}.weight is {FLOAT8_DTYPE} of shape {tuple(meta.shape)}"
        )
    rows = (meta.shape[0],) + (1,) * (meta.dim() - 1)
    if (
        scale.dtype != torch.float32
        or tuple(scale.shape) != rows
        or not bool((torch.isfinite(scale) & (scale > 0)).all())
    ):
        raise ValueError(
            f"checkpoint entry {leaf.marker!r} is {scale.dtype} of shape {tuple(scale.shape)}; accepted: float32 "
            f"of shape {rows}, finite and > 0 (one scale per row)"
        )
    slots.fill(meta, weight.to(meta.dtype) * scale.to(meta.dtype))


def _stream(
    model: nn.Module, checkpoint: Checkpoint, plan: FitPlan, layout: dict[str, StoredLeaf], device: Any
) -> None:
    """Read ``checkpoint`` into ``model`` (a skeleton on meta whose quantized leaves are
    shells) unit by unit, each stored and placed by the plan's executor as soon as it is
    read. A unit holding no quantized leaf streams as in a plain checkpoint; in one that
    does, each shell loads its stored entries as they are, float8 leaves are cast again
    from their stored values, and on disk it is mapped from the file in place where none
    of its tensors converts."""
    slots = _Slots(model)
    sources = _sources(model, slots, checkpoint)
    pending = {leaf.name: leaf for leaf in layout.values() if leaf.storage != "keep"}
    names = set(sources.values()) | {key for leaf in pending.values() for key in leaf.keys}
    executor = PlanExecutor(model, plan, device)
    with task(f"reading {len(plan.entries)} units", sum(checkpoint.entries[n].nbytes for n in names)) as advance:
        with muted():
            for entry in executor.entries:
                unit = model if entry.kind == "rest" else model.get_submodule(entry.module)
                inside = [
                    (name, module)
                    for name, module in unit.named_modules(prefix="" if entry.kind == "rest" else entry.module)
                    if name in pending
                ]
                if not inside:
                    _stream_entry(executor, entry, checkpoint, slots, sources, advance)
                    continue
                cast = sorted(name for name, _ in inside if pending[name].storage == "float8")
                for name in cast:
                    _fill_float8(dict(inside)[name], pending[name], checkpoint, slots, advance)
                mapped = entry.placement == "disk" and not cast and not _converts(unit, checkpoint, sources)
                files = _map_unit(unit, entry.module, checkpoint, slots, sources, advance) if mapped else []
                _read_unit(unit, checkpoint, slots, sources, advance)
                for name, module in inside:
                    if name not in cast:
                        _load_shell(module, pending[name], checkpoint, advance)
                    del pending[name]
                if cast:
                    executor.store(entry, cast)
                executor.place(entry, files)
    _check_filled(model, plan)
    executor.finish()
    model.eval()


def _saved_plan(folder: Path) -> FitPlan | None:
    file = folder / PLAN_FILE
    if not file.is_file():
        return None
    text = read_text(file)
    try:
        return FitPlan.from_json(text)
    except (ValueError, TypeError) as error:
        message = str(error)  # from_json names its argument "text": name the file instead
        raise ValueError(f"{file} {message[5:]}" if message.startswith("text ") else f"{file}: {message}") from None


def load_quantized(
    folder: Path,
    budget: int | str | None,
    *,
    plan: FitPlan | None,
    example_inputs: Any,
    backend: Any,
    allow: Allow | Mapping[str, Any] | None,
    calibration: Calibration | None,
    kind: str | None,
    model: nn.Module | None = None,
    units: str = "layers",
) -> tuple[nn.Module, FitPlan]:
    """:func:`tightfit.load` for a folder that :func:`holds_quantized`: (model, plan).

    The plan is ``plan`` when given; else, with ``budget``, a new one whose placements fit
    it on ``backend`` (the storages are the checkpoint's: ``allow`` restricts placements
    and hints only; ``FitError`` before any weight is read when even the disk is not
    enough); else the plan saved in the folder, used as it is, on its own device (a
    ``backend`` naming another device is refused: pass a budget to plan for it). A
    bitsandbytes folder has no saved plan: it needs a budget or a plan. The stored
    tensors load as they are; the model's dtype is the config's, and a 4-bit layer
    computes in ``bnb_4bit_compute_dtype``. ``model``: the folder's skeleton, made already.
    :func:`tightfit.load` has checked that a given ``plan`` comes alone.
    """
    saved = _saved_plan(folder)
    fixed = plan if plan is not None else saved
    if budget is None and plan is None:
        if saved is None:
            raise ValueError(
                f"budget is needed to plan the load of {folder} (bytes or a size such as '6GB'), or pass plan; "
                f"a folder that tightfit.save wrote needs neither"
            )
        given = [name for name, value in (("example_inputs", example_inputs), ("allow", allow)) if value is not None]
        given += ["calibration"] if calibration is not None else []
        given += ["units"] if units != "layers" else []
        if given:
            raise ValueError(
                f"{', '.join(given)} apply only to a new plan; pass budget too, or leave them out to load "
                f"{folder} with its saved plan"
            )
    if model is None:
        model, config = skeleton(folder, kind)
    else:
        check_type("model", model, nn.Module)
        config = getattr(model, "config", None)
        if config is None:
            raise TypeError(f"model must be the folder's skeleton (a transformers model), got {type(model).__name__}")
    checkpoint = Checkpoint(folder)
    raw = read_json(folder / "config.json")
    where = f"{folder}/config.json: quantization_config"
    settings = bitsandbytes_settings(raw["quantization_config"], where) if "quantization_config" in raw else None
    layout = stored_layout(model, checkpoint)
    same = settings is None or settings.compute_dtype == checkpoint_dtype(config)
    compute = None if same else settings.compute_dtype  # 4-bit layers then run in bnb_4bit_compute_dtype
    if fixed is not None:
        source = "the plan given" if plan is not None else f"{folder / PLAN_FILE}"
        if fixed.model != type(model).__name__:
            raise ValueError(f"{source} was made for {fixed.model}, but {folder} holds a {type(model).__name__}")
        if not fixed.covers_load:
            raise ValueError(f"{source} does not cover loading: make it with tightfit.load or fit(..., loading=True)")
        check_planned(layout, fixed, model, source)
    elif settings is not None:
        check_bitsandbytes(layout, settings, checkpoint)
    if plan is None and budget is not None:
        cast = next((leaf for leaf in layout.values() if leaf.storage == "float8"), None)
        if cast is not None:
            raise ValueError(
                f"{folder} holds float8 weights ({cast.marker!r}, ...), which are cast again on loading, a "
                f"conversion a new plan does not count: leave budget out to load it with its saved plan"
            )
        inputs = (
            default_inputs(config, kind or model_kind(config)) if example_inputs is None else on_meta(example_inputs)
        )
        size = parse_size(budget, "budget")
        plan = _plan(model, layout, checkpoint, inputs, size, backend, allow, calibration, compute, units)
        device = torch.device(plan.device)  # the device the planner resolved
    else:
        plan = fixed
        device = _plan_device(plan, backend)
    threshold = settings.threshold if settings is not None else storage_format("int8").config.threshold
    modules = dict(model.named_modules())
    shells = {
        leaf.name: _shell(modules[leaf.name], leaf, checkpoint, threshold)
        for leaf in layout.values()
        if leaf.storage in MODULES
    }
    swap_modules(model, shells)
    for shell in shells.values() if compute is not None else ():
        if isinstance(shell, Linear4bit):
            HookRegistry.of(shell).register(COMPUTE_DTYPE, _ComputeIn(compute))
    _stream(model, checkpoint, plan, layout, device)
    return model, plan
