"""What the planner chooses between: the model's units (one per layer of its repeated
stack, one per Linear / Embedding outside it, and the rest), and for each unit the
options (storage x placement) with their predicted device bytes and seconds.

Bytes follow the formats' layouts exactly (see docs/quantization.md): a 4-bit weight
is half a byte per value plus a float32 scale per block of 64 and a 16-entry map; an
8-bit blockwise weight one byte plus a scale per 4096 and a 256-entry map; int8 one
byte plus a float32 scale per row; float8 one byte plus a power-of-two float32 scale
per row. Biases, norms and other tensors keep their dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tightfit.fitting.outliers import assumed_outliers
from tightfit.hooks.casting import dtype_deciders
from tightfit.memory import tensor_bytes
from tightfit.quant import Blockwise8Config, FP4Config, Int8Config, NF4Config, QuantConfig, layer_stack
from tightfit.quant.layers import largest_repeated_list

if TYPE_CHECKING:
    from tightfit.fitting.calibration import Calibration

__all__ = ["DECODED_STORAGES", "FLOAT8_DTYPE", "Option", "PLACEMENTS", "QUANT_CONFIGS", "STORAGES", "Unit", "find_units", "options_for"]

#: Storages, in the order the planner prefers them at equal predicted time.
STORAGES = ("keep", "float8", "8bit", "int8", "nf4", "fp4")
#: Where a unit's weights live between forwards.
PLACEMENTS = ("device", "cpu", "disk")
#: Storages decoded during each forward (everything but ``keep``).
DECODED_STORAGES = STORAGES[1:]
#: The float8 kind that ``float8`` storage uses (layerwise casting, scaled per row).
FLOAT8_DTYPE = torch.float8_e4m3fn
#: The quantization config of each quantized storage.
QUANT_CONFIGS: dict[str, QuantConfig] = {"nf4": NF4Config(), "fp4": FP4Config(), "int8": Int8Config(), "8bit": Blockwise8Config()}

_PAGE = 4096  # bytes the OS reads per touched page of a memory-mapped file
_RANK = {"keep": 0, "float8": 1, "8bit": 1, "int8": 1, "nf4": 2, "fp4": 3}  # precision, most precise first
_NOISE = {"float8": 1.0, "8bit": 1.0, "int8": 1.0, "nf4": 16.0, "fp4": 24.0}  # relative rounding noise per weight
_TIE = 1e-12  # seconds per unit of noise: breaks ties between options of equal cost only


@dataclass(frozen=True)
class Unit:
    """A group of modules the planner decides for as one.

    ``weights``: the qualified names of its ``nn.Linear`` and ``nn.Embedding`` leaves, with
    (shape, dtype); ``bytes``: all its tensors as they are; ``rows``: rows each leaf
    computed in the traced forward (tokens for an embedding); ``fixed``: the reason it
    must stay as it is, or ""; ``no_float8``: the reason float8 storage is ruled out, or "".
    """

    name: str
    kind: str  # "layer", "linear", "embedding" or "rest"
    weights: tuple[tuple[str, str, tuple[int, ...], torch.dtype], ...]  # (name, type, shape, dtype)
    bytes: int
    other_bytes: int  # tensors in the unit that are not leaf weights (biases, norms)
    fixed: str = ""  # why it must stay as it is, where it is ("" when free)
    no_float8: str = ""  # why float8 storage is ruled out ("" when it is not)

    def quantizable(self) -> bool:
        return any(kind == "Linear" and dtype in (torch.float32, torch.float16, torch.bfloat16) for _, kind, _, dtype in self.weights)


@dataclass(frozen=True)
class Option:
    """One way to hold a unit: its bytes held on the device between forwards; the device's
    activation bytes while it computes with decoded weights (activations alive then,
    inputs, the largest decoded copy; 0 when nothing is decoded); the bytes copied onto
    the device for each forward; and its predicted seconds per forward.

    ``cost`` is what the search minimizes: ``seconds``, except that a storage never
    counts as faster than a more precise one (keep, then the 8-bit ones, then nf4, then
    fp4) at the same placement or on the device, so that weights lose precision only to
    meet the budget, never for speed alone; plus a tie-break for quantization noise
    (1e-12 s per weight stored in b bits, times 2^(8 - b), fp4 half as much again), so
    that at equal cost the most precise storage stays.
    """

    storage: str
    placement: str
    stored_bytes: int  # the unit's bytes in this storage, wherever they live
    held_bytes: int  # of those, held in the device's memory between forwards
    compute_peak_bytes: int  # activations + inputs + decoded copy while its leaves compute
    onload_bytes: int  # copied onto the device for each forward (offloaded to cpu/disk, accelerators)
    seconds: float
    cost: float


def _weight_bytes(storage: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = math.prod(shape)
    if storage == "keep":
        return numel * dtype.itemsize
    if storage == "float8":
        return numel + shape[0] * 4
    if storage in ("nf4", "fp4"):
        return (numel + 1) // 2 + math.ceil(numel / 64) * 4 + 16 * 4
    if storage == "8bit":
        return numel + math.ceil(numel / 4096) * 4 + 256 * 4
    if storage == "int8":
        return numel + shape[0] * 4
    raise ValueError(f"storage={storage!r} is not accepted; accepted: {', '.join(STORAGES)}")


def _tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    return {id(t): t for t in [*module.parameters(), *module.buffers()]}


def _owners(root: nn.Module) -> dict[int, int]:
    """How many modules under ``root`` (shared modules once) hold each tensor directly."""
    owners: dict[int, int] = {}
    for module in root.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                owners[id(tensor)] = owners.get(id(tensor), 0) + 1
    return owners


def _stored_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters and buffers."""
    return tensor_bytes(_tensors(module).values())


def _groups(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    stack = set(layer_stack(model) or largest_repeated_list(model, _stored_bytes))  # GPT-2's Conv1D: by bytes
    groups: list[tuple[str, str, nn.Module]] = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        if any(name == prefix or name.startswith(prefix + ".") for prefix in inside):
            continue
        if name in stack:
            groups.append((name, "layer", module))
            inside.add(name)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and isinstance(getattr(module, "weight", None), torch.Tensor):
            groups.append((name, "linear" if isinstance(module, nn.Linear) else "embedding", module))
            inside.add(name)
    return groups


def find_units(model: nn.Module) -> list[Unit]:
    """The model's units in module order, the rest last.

    A unit holding a tensor that a module outside it holds too (tied weights) stays as
    it is; the tensor counts in the first unit that holds it.
    """
    owners = _owners(model)
    deciders = dtype_deciders(model)  # model.dtype reads them: layerwise casting leaves them as they are
    units, covered = [], {}
    for name, kind, module in _groups(model):
        tensors = _tensors(module)
        inner = _owners(module)
        if any(inner[key] < owners[key] for key in tensors):
            own = {k: v for k, v in tensors.items() if k not in covered}
            size = tensor_bytes(own.values())
            units.append(Unit(name, kind, (), size, size, "shares a tensor with a module outside it (tied weights)"))
            covered.update(tensors)
            continue
        leaves = [(f"{name}.{leaf_name}" if leaf_name else name, leaf) for leaf_name, leaf in module.named_modules()
                  if type(leaf) in (nn.Linear, nn.Embedding)]
        weights = tuple((leaf_name, type(leaf).__name__, tuple(leaf.weight.shape), leaf.weight.dtype) for leaf_name, leaf in leaves)
        weight_ids = {id(leaf.weight) for _, leaf in leaves}
        no_float8 = "model.dtype reads its weight, which must keep its dtype" if weight_ids & deciders else ""
        other = tensor_bytes(v for k, v in tensors.items() if k not in weight_ids)
        units.append(Unit(name, kind, weights, tensor_bytes(tensors.values()), other, "", no_float8))
        covered.update(tensors)
    rest = {k: v for k, v in _tensors(model).items() if k not in covered}
    if rest:
        size = tensor_bytes(rest.values())
        units.append(Unit("(rest)", "rest", (), size, size, "norms, biases and buffers outside the units"))
    return units


def options_for(unit: Unit, *, storages: frozenset[str], placements: frozenset[str], device: torch.device,
                rows: dict[str, int], live: dict[str, int], figures: Calibration,
                outliers: dict[str, int] | None = None, call_rows: dict[str, int] | None = None) -> list[Option]:
    """The options of ``unit`` that ``storages`` and ``placements`` allow, each with bytes and seconds.

    ``rows``: rows each leaf computed in the traced forward (summed over calls: its time);
    ``call_rows``: the most rows of one of its calls (the buffers an int8 forward allocates
    exist per call; default ``rows``, for a leaf called once); ``live``:
    the most activation and input bytes alive while each leaf computes (its own output
    included); ``figures``: the time model's figures; ``outliers``: input columns each
    Linear's LLM.int8() outlier path takes (:func:`~tightfit.fitting.outliers.observe_outliers`),
    or None where not observed (then :func:`~tightfit.fitting.outliers.assumed_outliers`).
    """
    if unit.fixed:
        storages, placements = frozenset({"keep"}), frozenset({"device"})
    on_host = device.type == "cpu"
    options = []
    for storage in STORAGES:
        if storage not in storages:
            continue
        if storage != "keep" and not unit.weights:  # only placement can change (a block of Conv1D layers, say)
            continue
        if (storage not in ("keep", "float8") and not unit.quantizable()) or (storage == "float8" and unit.no_float8):
            continue
        stored, decoded, decode_seconds, compute_seconds, touched = unit.other_bytes, 0, 0.0, 0.0, unit.other_bytes
        noise = 0.0
        for name, kind, shape, dtype in unit.weights:
            leaf_storage = storage if kind == "Linear" or storage in ("keep", "float8") else "keep"
            size = _weight_bytes(leaf_storage, shape, dtype)
            stored += size
            numel, count = math.prod(shape), rows.get(name, 0)
            if kind == "Linear":
                compute_seconds += 2 * numel * count / figures.matmul_flops
                touched += size
            else:  # an embedding kept as it is reads only the rows it looks up (whole pages from a file)
                touched += min(size, count * max(size // shape[0], _PAGE)) if leaf_storage == "keep" else size
            if leaf_storage != "keep":
                noise += numel * _NOISE[leaf_storage]
                decode_seconds += numel * figures.decode_seconds[leaf_storage]
                if leaf_storage == "int8":
                    columns = assumed_outliers(shape[1]) if outliers is None else outliers.get(name, 0)
                    one_call = count if call_rows is None else call_rows.get(name, count)
                    copy = _int8_transient(shape, one_call, columns, dtype.itemsize)
                else:
                    copy = numel * dtype.itemsize
                decoded = max(decoded, live.get(name, 0) + copy)
        for placement in PLACEMENTS:
            if placement not in placements or (placement == "cpu" and on_host):
                continue
            held = stored if placement == "device" else _scales_held(unit, storage)
            seconds = compute_seconds + decode_seconds + touched / figures.device_bandwidth
            onload = 0
            if placement != "device" and not on_host:
                onload = stored - held
                seconds += onload / figures.host_to_device_bandwidth
            if placement == "disk":
                seconds += (touched if on_host else stored) / figures.disk_bandwidth
            floor = max((o.seconds for o in options if _RANK[o.storage] < _RANK[storage] and o.placement in (placement, "device")),
                        default=0.0)  # options come in order of precision
            options.append(Option(storage, placement, stored, held, decoded, onload, seconds, max(seconds, floor) + _TIE * noise))
    return options


def _int8_transient(shape: tuple[int, ...], rows: int, outliers: int, itemsize: int) -> int:
    """Bytes an LLM.int8() forward (``LinearInt8.forward`` with a threshold, as planned)
    allocates above what the kept layer holds at its end (its output, ``itemsize`` bytes
    a value, which the int8 output replaces), at the largest of its three peaks. The
    kernels are the reference ones (used on the CPU); their buffers inside one op are
    counted too, though no per-op count of live tensors sees them.

    1. ``int8_vectorwise_quant``: the input with outliers masked, the outlier mask, the
       outlier indices, the row scales and their reciprocals, and scaling and rounding
       in float32 (the input cast to float32 first where it is not).
    2. ``int8_mm_dequant``, with the int8 input, row scales, outlier indices and int32
       product alive: the float32 outer product of the scales, the product cast to
       float32 and the scaled result.
    3. Only with ``outliers`` input columns, with the same alive and the output: the
       larger of dequantizing those columns' weights (the int8 columns, them as float32,
       the scales / 127, the scaled columns) or adding them back (the columns in the
       activation dtype, the input's columns, a second output).
    """
    out_features, in_features = shape
    output = itemsize * rows * out_features
    quantize = (itemsize + 9) * rows * in_features + 8 * rows + 8 * outliers - output
    held = rows * in_features + 4 * rows + 4 * rows * out_features + 8 * outliers
    dequantize = 12 * rows * out_features - output
    if outliers:
        weights = 9 * out_features * outliers + 4 * out_features
        add_back = itemsize * (out_features * outliers + rows * outliers) + output
        dequantize = max(dequantize, weights, add_back)
    return max(quantize, held + dequantize)


def _scales_held(unit: Unit, storage: str) -> int:
    """Quantization scales and maps stay on the device when a unit is offloaded (they are
    not parameters or buffers, which offloading moves)."""
    if storage not in ("nf4", "fp4", "8bit"):
        return 0
    return sum(_weight_bytes(storage, shape, dtype) - math.ceil(math.prod(shape) / (2 if storage != "8bit" else 1))
               for _, kind, shape, dtype in unit.weights if kind == "Linear")
