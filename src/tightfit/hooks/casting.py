"""Layerwise casting: store weights in float8 (or another narrow dtype), compute in bf16,
fp16 or fp32, one layer at a time.

Unlike a cast of the whole layer up before and back down after each forward, the stored
tensor is never touched during a forward: the hook builds an upcast copy, hands it to
the layer for that forward, and drops it afterwards (no down-cast, no second stored
copy). Float8 storage is scaled by default: a power-of-two scale per output channel
(or per tensor) kept beside the weight as ``<name>_scale`` and applied in the upcast;
powers of two make that multiplication exact in every compute dtype.

An ``nn.Linear`` (its own ``forward``, no hook inside this one) with a float8_e4m3fn or
float8_e5m2 weight on the CPU that gets at most ``FEW_TOKENS`` rows skips the upcast:
``tightfit.ops.gemv_float8`` reads the stored bytes once, decoding them in registers
(decoding is what a few-token forward is made of), so no upcast copy exists then. It
computes what the upcast and ``F.linear`` compute, to the rounding of the sum's order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tightfit import backends, ops
from tightfit._progress import task
from tightfit._validate import check_choice, check_type
from tightfit.backends.base import FLOAT8_DTYPES
from tightfit.hooks import _diffusers
from tightfit.hooks._exclusive import OneForwardAtATime
from tightfit.hooks._units import Granularity, Slot, Unit, all_slots, check_granularity, compile_patterns, select_units
from tightfit.hooks.offload import OFFLOADING
from tightfit.hooks.registry import HookRegistry, ModuleHook
from tightfit.ops.blockwise_gemv import FEW_TOKENS
from tightfit.ops.float8_gemv import FLOAT8_FORMATS, upcast_float8

logger = logging.getLogger("tightfit.hooks")

__all__ = [
    "COMPUTE_DTYPES",
    "DEFAULT_SKIP",
    "LAYERWISE_CASTING",
    "SCALES",
    "STORAGE_DTYPES",
    "LayerwiseCastingHook",
    "apply_layerwise_casting",
    "remove_layerwise_casting",
]

#: Name of the casting hook in a module's :class:`HookRegistry`.
LAYERWISE_CASTING = "tightfit.layerwise_casting"

#: Regexes (searched in each module's qualified name and class name) skipped by default:
#: norms, embeddings and positional embeddings lose too much in float8, and LoRA-style
#: adapters stay trainable in full precision.
DEFAULT_SKIP: tuple[str, ...] = (r"(?i)norm", r"(?i)embed(ding)?s?$", r"(?i)pos(_|ition)", r"(?i)lora_")

#: Accepted ``scale`` values: per output channel, per tensor, or none (a plain cast).
SCALES = ("channel", "tensor", None)

#: dtypes weights may be stored in (float8_e8m0fnu holds only powers of two: a scale format).
STORAGE_DTYPES: frozenset[torch.dtype] = frozenset(
    FLOAT8_DTYPES - {getattr(torch, "float8_e8m0fnu", None)} | {torch.bfloat16, torch.float16}
)

#: dtypes a cast layer may compute in.
COMPUTE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})


@dataclass(eq=False)
class _Record:
    """One distinct tensor a casting hook handles (tied weights share a record)."""

    tensor: torch.Tensor  # the module's own tensor object; its ``.data`` is what is stored
    original_dtype: torch.dtype
    requires_grad: bool
    stored: bool = False  # held in the storage dtype now
    scale: torch.Tensor | None = None
    original: torch.Tensor | None = None  # kept on the CPU with keep_originals=True


@dataclass(eq=False)
class _Entry:
    """One slot a hook fills for the forward, the tensor's record, and where its scale lives."""

    slot: Slot
    record: _Record
    scale_slot: Slot | None = None


def _power_of_two_scale(
    x: torch.Tensor, mode: str, storage_dtype: torch.dtype, compute_dtype: torch.dtype
) -> torch.Tensor:
    """The smallest power of two s with max |x| / s <= the storage dtype's largest value.

    Per output channel (shape (rows, 1, ...)) or per tensor (shape ()); clamped to
    powers of two the compute dtype holds as normal numbers, so applying it is exact.
    """
    magnitude = x.detach().abs()
    if mode == "channel":
        amax = magnitude.amax(dim=tuple(range(1, x.dim())), keepdim=True).float()
    else:
        amax = magnitude.amax().float()
    mantissa, exponent = torch.frexp(amax / torch.finfo(storage_dtype).max)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own ceiling
    finfo = torch.finfo(compute_dtype)
    lowest, highest = int(torch.tensor(finfo.tiny).log2()), int(torch.tensor(finfo.max).log2().floor())
    scale = torch.ldexp(torch.ones_like(amax), exponent.clamp(lowest, highest))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _to_storage(
    x: torch.Tensor, storage_dtype: torch.dtype, scale_mode: str | None, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored tensor, scale or None), converted through ``tightfit.ops.cast``."""
    source = x.detach()
    if source.dtype not in ops.CAST_DTYPES:
        source = source.float()
    if scale_mode is None or storage_dtype not in FLOAT8_DTYPES:
        return ops.cast(source, storage_dtype), None
    scale = _power_of_two_scale(source, scale_mode, storage_dtype, compute_dtype)
    return ops.cast(source / scale.to(source.dtype), storage_dtype), scale


#: Below this many elements a CPU tensor is upcast with torch's own conversion: it costs
#: less than the cast op's Python dispatch, and it is what the op's CPU kernel runs there.
_SMALL_CPU_NUMEL = 1 << 14


def _upcast(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``upcast_float8`` (``gemv_float8``'s specification), the conversion by ``tightfit.ops.cast``
    where that runs faster (its bits are torch's)."""
    if stored.device.type == "cpu" and stored.numel() <= _SMALL_CPU_NUMEL and not torch.compiler.is_compiling():
        return upcast_float8(stored, scale, dtype)
    weight = ops.cast(stored, dtype)
    if scale is not None:
        weight.mul_(scale if scale.dtype == dtype else scale.to(dtype))
    return weight


class LayerwiseCastingHook(ModuleHook):
    """Presents the unit's stored tensors in the compute dtype for each forward, then drops the
    copies; a few-token ``nn.Linear`` forward on the CPU reads its float8 weight as stored."""

    order = 20
    diffusers_name = "layerwise_casting"

    def __init__(self, entries: list[_Entry], storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        self.entries = entries
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        # a stack (a module may run inside itself): the stored tensors, and the weight's entry
        # when the forward runs gemv_float8 on it instead (None: the module's forward runs)
        self._saved: list[tuple[list[torch.Tensor], _Entry | None]] = []
        self._claim = OneForwardAtATime(LAYERWISE_CASTING)

    def __repr__(self) -> str:
        stored = sum(entry.record.stored for entry in self.entries)
        return f"LayerwiseCastingHook({stored} tensors stored as {self.storage_dtype}, compute {self.compute_dtype})"

    def _present(self, entry: _Entry, current: torch.Tensor) -> torch.Tensor:
        if entry.record.stored and current.dtype == self.storage_dtype:
            # read the scale from its slot: an offloading hook may have put a device copy there
            return _upcast(current, entry.scale_slot.get() if entry.scale_slot else None, self.compute_dtype)
        return current.to(self.compute_dtype)

    def _fused_weight(self, module: nn.Module, args: tuple, kwargs: dict, stored: list[torch.Tensor]) -> int | None:
        """The index of the weight's entry when this forward is a few-token ``nn.Linear`` one on
        the CPU that ``gemv_float8`` computes from the stored weight, else None. Metadata only,
        so a trace on fake tensors takes the same path as the run it predicts."""
        if self.storage_dtype not in FLOAT8_FORMATS or torch.compiler.is_compiling():
            return None
        if type(module).forward is not nn.Linear.forward or not _innermost(self, module):
            return None
        x = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args and len(kwargs) == 1 else None
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != self.compute_dtype or x.dim() < 1:
            return None
        index = next(
            (i for i, e in enumerate(self.entries) if e.slot.owner is module and e.slot.name == "weight"), None
        )
        if index is None:
            return None
        entry, tensor = self.entries[index], stored[index]
        scale = entry.scale_slot.get() if entry.scale_slot else None
        bias = module.bias  # presented in the compute dtype on its device, if it is not already
        if (
            not entry.record.stored
            or tensor.dtype != self.storage_dtype
            or tensor.device.type != "cpu"
            or tensor.dim() != 2
            or not tensor.is_contiguous()
            or x.shape[-1] != tensor.shape[1]
            or not 0 < x.numel() // max(tensor.shape[1], 1) <= FEW_TOKENS
            or (scale is not None and scale.device.type != "cpu")
            or (bias is not None and (bias.device.type != "cpu" or bias.dim() != 1))
        ):
            return None
        return index

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._claim.enter(module)
        stored = [entry.slot.get() for entry in self.entries]
        try:
            fused = self._fused_weight(module, args, kwargs, stored)
            presented = [
                tensor if index == fused else self._present(entry, tensor)
                for index, (entry, tensor) in enumerate(zip(self.entries, stored))
            ]  # nothing changed yet
        except BaseException:
            self._claim.exit()
            raise
        for entry, tensor in zip(self.entries, presented):
            entry.slot.set(tensor)
        self._saved.append((stored, None if fused is None else self.entries[fused]))
        return args, kwargs

    def around(self, module: nn.Module, call, args: tuple, kwargs: dict) -> object:
        fused = self._saved[-1][1] if self._saved else None
        if fused is None:
            return call(*args, **kwargs)
        # nn.Linear.forward, with nothing inside this hook: F.linear(x, upcast weight, bias), fused
        x = args[0] if args else kwargs["input"]
        scale = fused.scale_slot.get() if fused.scale_slot else None
        return ops.gemv_float8(x, module.weight, scale, module.bias)

    def _restore(self) -> None:
        stored, _ = self._saved.pop()
        for entry, tensor in zip(self.entries, stored):
            entry.slot.set(tensor)

    def post_forward(self, module: nn.Module, output: object) -> object:
        self._restore()
        self._claim.exit()
        return output

    def abort(self, module: nn.Module) -> None:
        if self._saved:
            self._restore()
        self._claim.exit()

    def detach(self, module: nn.Module) -> None:
        for entry in self.entries:
            if entry.record.stored:
                _restore_record(entry.record)
            if entry.scale_slot is not None:
                entry.scale_slot.table.pop(entry.scale_slot.name, None)


def _innermost(hook: ModuleHook, module: nn.Module) -> bool:
    """Whether ``hook`` is the last of ``module``'s hooks and what it encloses is the module's
    own ``forward`` (not one set on the instance), so computing that forward's result in its
    place skips nothing."""
    registry = HookRegistry.get(module)
    if registry is None:
        return False
    names = registry.names()
    inner = getattr(registry._inner_forward, "__func__", None)
    return bool(names) and registry.hook(names[-1]) is hook and inner is type(module).forward


def _restore_record(record: _Record) -> None:
    tensor = record.tensor
    if record.original is not None:
        tensor.data = record.original.to(tensor.device)
    else:
        tensor.data = _upcast(tensor.data, record.scale, torch.float32).to(record.original_dtype)
    tensor.requires_grad_(record.requires_grad)
    record.stored = False
    record.original = None


def _hooked_modules(module: nn.Module, name: str) -> list[nn.Module]:
    return [m for m in module.modules() if (r := HookRegistry.get(m)) is not None and name in r]


def _check_dtypes(storage_dtype: object, compute_dtype: object) -> None:
    check_type("storage_dtype", storage_dtype, torch.dtype)
    check_type("compute_dtype", compute_dtype, torch.dtype)
    if not compute_dtype.is_floating_point:
        raise ValueError(
            f"compute_dtype={compute_dtype} is not a floating-point dtype; accepted: bfloat16, float16, float32"
        )
    check_choice("compute_dtype", compute_dtype, COMPUTE_DTYPES)
    if storage_dtype != compute_dtype:
        check_choice("storage_dtype", storage_dtype, STORAGE_DTYPES)


def model_pins(module: nn.Module) -> tuple[str, ...]:
    """The names a diffusers model pins to full precision: its ``_keep_in_fp32_modules`` and
    ``_skip_layerwise_casting_patterns`` (regexes searched in qualified names, as diffusers'
    ``enable_layerwise_casting`` does). Read by attribute name; any module may declare them."""
    pins: list[str] = []
    for attribute in ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns"):
        names = getattr(module, attribute, None)
        if names is None:
            continue
        if isinstance(names, str) or not all(isinstance(name, str) for name in names):
            raise TypeError(f"{type(module).__name__}.{attribute} must be a list of str, got {names!r}")
        pins += [name for name in names if name not in pins]
    return tuple(pins)


def _check_backends(tensors: list[torch.Tensor], storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    for device in sorted({t.device for t in tensors}, key=str):
        backend = backends.get(device)
        capabilities = backend.capabilities()
        if storage_dtype not in capabilities.storage_dtypes:
            raise ValueError(
                f"storage_dtype={storage_dtype} cannot be held by backend {backend.name} (tensors on {device}); "
                f"it stores: {', '.join(sorted(str(d) for d in capabilities.storage_dtypes if d.is_floating_point))}"
            )
        if compute_dtype not in capabilities.compute_dtypes:
            raise ValueError(
                f"compute_dtype={compute_dtype} is not computed by backend {backend.name} (tensors on {device})"
            )


def apply_layerwise_casting(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    *,
    granularity: Granularity = "leaf",
    skip: str | tuple[str, ...] = DEFAULT_SKIP,
    scale: str | None = "channel",
    non_blocking: bool = False,
    keep_originals: bool = False,
    pins: bool = True,
) -> list[str]:
    """Store ``module``'s weights in ``storage_dtype`` and compute each unit in ``compute_dtype``.

    Floating-point parameters and buffers with two or more dimensions and finite values
    are stored in ``storage_dtype`` (float8 ones with a power-of-two ``scale`` per output
    channel, per tensor, or none); other floating-point tensors keep their dtype and are
    presented in ``compute_dtype``. Stored tensors no longer require grad. ``granularity``
    (``"leaf"``, ``"block"``, ``"model"`` or a callable ``(name, module) -> bool``) picks
    the modules that get a hook; ``skip`` regexes (searched in qualified names and class
    names) leave modules as they are, ``DEFAULT_SKIP`` by default. A tensor shared with a
    module that is not cast keeps its dtype. With ``pins`` (the default), the names ``module``
    pins to full precision (diffusers' ``_keep_in_fp32_modules`` and
    ``_skip_layerwise_casting_patterns``) are skipped too, searched in qualified names only.
    A tensor whose qualified name a skip pattern or a pin finds (a bare parameter such as
    Wan's ``blocks.0.scale_shift_table``) keeps its dtype and is left out of its module's
    hook; those names are logged (logger ``tightfit.hooks``, INFO). ``storage_dtype ==
    compute_dtype`` leaves ``module`` as it is (nothing is hooked; returns ``[]``).
    ``keep_originals`` keeps a CPU copy of each stored tensor so that
    :func:`remove_layerwise_casting` restores it bit for bit.
    ``non_blocking`` is accepted for diffusers compatibility; the upcast runs on the
    tensor's device, so there is no copy to make asynchronous.

    Returns the qualified names of the hooked modules (``""`` is ``module`` itself).
    """
    check_type("module", module, nn.Module)
    _check_dtypes(storage_dtype, compute_dtype)
    check_granularity(granularity)
    skip_patterns = compile_patterns("skip", skip)
    check_choice("scale", scale, SCALES)
    check_type("non_blocking", non_blocking, bool)
    check_type("keep_originals", keep_originals, bool)
    check_type("pins", pins, bool)
    if _hooked_modules(module, LAYERWISE_CASTING):
        raise ValueError(
            "layerwise casting is already applied to this module; call remove_layerwise_casting(module) first"
        )
    if _hooked_modules(module, OFFLOADING):
        raise ValueError(
            "this module is offloaded; apply layerwise casting first, then offloading "
            "(remove_offloading(module), then apply both in that order)"
        )
    if storage_dtype == compute_dtype:
        return []  # the weights are stored as they compute: there is nothing to hook
    pinned = compile_patterns("pins", model_pins(module)) if pins else ()
    kept: list[str] = []
    units = select_units(module, granularity, skip_patterns, skip_names=pinned, kept=kept)
    if kept:
        logger.info("layerwise casting keeps %d tensors named by a skip pattern or pin: %s", len(kept), ", ".join(kept))
    visible = _diffusers.wanted(module)
    return _apply_layerwise_casting(module, units, storage_dtype, compute_dtype, scale, keep_originals, visible)


def _apply_layerwise_casting(
    module: nn.Module,
    units: list[Unit],
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    scale_mode: str | None,
    keep_originals: bool,
    visible: bool,
) -> list[str]:
    covered = {(id(slot.owner), slot.name) for unit in units for slot in unit.slots}
    keep = {id(slot.get()) for slot in all_slots(module) if (id(slot.owner), slot.name) not in covered}
    keep |= dtype_deciders(module)
    records: dict[int, _Record] = {}
    plans = []
    for unit in units:
        entries = []
        for slot in unit.slots:
            tensor = slot.get()
            if not tensor.is_floating_point():
                continue
            record = records.get(id(tensor))
            if record is None:
                store = (
                    tensor.dim() >= 2
                    and id(tensor) not in keep
                    and tensor.dtype != storage_dtype
                    and bool(torch.isfinite(tensor).all())
                )
                record = records[id(tensor)] = _Record(tensor, tensor.dtype, tensor.requires_grad, stored=store)
            if record.stored or tensor.dtype != compute_dtype:
                entries.append(_Entry(slot, record))
        if entries:
            plans.append((unit, entries))
    stored = [record for record in records.values() if record.stored]
    _check_backends([record.tensor for record in stored], storage_dtype, compute_dtype)
    scaled = scale_mode is not None and storage_dtype in FLOAT8_DTYPES
    if scaled:
        _check_scale_names(plans)
    with task(f"casting weights to {str(storage_dtype).removeprefix('torch.')}", len(stored)) as advance:
        for record in stored:
            if keep_originals:
                record.original = record.tensor.detach().to("cpu", copy=True)
            data, record.scale = _to_storage(record.tensor, storage_dtype, scale_mode, compute_dtype)
            record.tensor.data = data
            record.tensor.requires_grad_(False)
            advance(1)
    for unit, entries in plans:
        for entry in entries:
            if entry.record.scale is not None:
                entry.scale_slot = Slot(entry.slot.owner, f"{entry.slot.name}_scale", False)
                entry.scale_slot.set(entry.record.scale)
        hook = LayerwiseCastingHook(entries, storage_dtype, compute_dtype)
        if not visible:
            hook.diffusers_name = None
        HookRegistry.of(unit.module).register(LAYERWISE_CASTING, hook)
    return [unit.name for unit, _ in plans]


def dtype_deciders(module: nn.Module) -> set[int]:
    """Ids of the first floating-point parameter of every module with a ``dtype`` property.

    Internal to tightfit (not in ``__all__``): layerwise casting and the fit planner both
    leave these tensors as they are.

    diffusers' ``ModelMixin`` and transformers' ``PreTrainedModel`` report that parameter's
    dtype as ``model.dtype`` and create tensors in it during forward (timestep embeddings,
    masks); it stays as it is so that ``model.dtype`` remains the dtype the model computes in.
    """
    ids = set()
    for submodule in module.modules():
        if isinstance(getattr(type(submodule), "dtype", None), property):
            first = next((p for p in submodule.parameters() if p.is_floating_point()), None)
            if first is not None:
                ids.add(id(first))
    return ids


def _check_scale_names(plans: list) -> None:
    for _, entries in plans:
        for entry in entries:
            slot, name = entry.slot, f"{entry.slot.name}_scale"
            if entry.record.stored and (
                name in slot.owner._parameters
                or name in slot.owner._buffers
                or name in slot.owner._modules
                or name in slot.owner.__dict__
            ):
                raise ValueError(
                    f"{type(slot.owner).__name__} already has an attribute {name!r}, where the float8 scale of "
                    f"{slot.name!r} would go; pass scale=None or skip this module"
                )


def remove_layerwise_casting(module: nn.Module) -> None:
    """Remove every casting hook under ``module``: forwards, dtypes and ``requires_grad`` come back.

    Values come back bit for bit with ``keep_originals=True``; otherwise they are the
    stored values upcast (what the hooked module computed with).
    """
    check_type("module", module, nn.Module)
    hooked = _hooked_modules(module, LAYERWISE_CASTING)
    if not hooked:
        raise ValueError("no layerwise casting is applied to this module")
    if _hooked_modules(module, OFFLOADING):
        raise ValueError(
            "this module is offloaded; call remove_offloading(module) before remove_layerwise_casting(module)"
        )
    for submodule in hooked:
        HookRegistry.get(submodule).remove(LAYERWISE_CASTING)
