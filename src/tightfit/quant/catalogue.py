"""The storage catalogue: one :class:`StorageFormat` per way a weight can be stored
(``keep``, ``bfloat16``, ``float8``, ``8bit``, ``int8``, ``nf4``, ``fp4``).

A format declares what every layer above needs to know of it: its name, its precision
rank, its bytes for a weight's shape (stored; held on the device when its layer is
offloaded; allocated while its layer computes), the probe that calibration times for its
decode cost, and how it is applied to a model. The fit planner, calibration,
``FitPlan.apply``, ``tightfit run --quant`` and ``--allow`` iterate the catalogue instead
of naming formats, so a new format is its ops, its quantized module and config, and one
:func:`register_format` call.
"""

from __future__ import annotations

import glob
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from tightfit import ops
from tightfit._validate import check_type
from tightfit.hooks import _diffusers
from tightfit.hooks.casting import COMPUTE_DTYPES, apply_layerwise_casting, dtype_deciders
from tightfit.ops import _cpu_int8_rows
from tightfit.quant.config import (
    Blockwise8Config,
    FP4Config,
    Int8Config,
    NF4Config,
    QuantConfig,
    handler_for,
    quantize_,
)
from tightfit.quant.modules import Linear4bit, Linear8bit, LinearInt8, QuantizedLinear

__all__ = [
    "FLOAT8_DTYPE",
    "StorageFormat",
    "quantized_format",
    "register_format",
    "storage_format",
    "storage_formats",
    "unregister_format",
]

Shape = tuple[int, ...]
#: A decode probe: given a full-precision ``nn.Linear`` and an input for it, the work whose
#: time is the format's decode cost, and the work whose time to subtract from it (or None).
Probe = Callable[[nn.Linear, torch.Tensor], tuple[Callable[[], Any], Callable[[], Any] | None]]

#: The float8 kind that ``float8`` storage uses (layerwise casting, scaled per row).
FLOAT8_DTYPE = torch.float8_e4m3fn


def _nothing(shape: Shape, dtype: torch.dtype) -> int:
    return 0


def _decoded_copy(shape: Shape, rows: int, outliers: int, dtype: torch.dtype) -> int:
    """A forward that decodes the whole weight into the compute dtype holds that copy."""
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class StorageFormat:
    """One way to store a weight, as the planner, calibration and ``apply`` see it.

    ``rank``: precision, 0 the most precise; the planner loses precision only to meet a
    budget. ``noise``: the relative RMS error a layer's output takes from its weight stored
    so (Gaussian weights and inputs; tests/quant/test_catalogue_noise.py measures each
    format against its figure): the planner's quality term, :mod:`tightfit.fitting.quality`. ``stored_bytes(shape, dtype)``: a weight's bytes
    stored so, wherever they live; ``held_offloaded(shape, dtype)``: of those, the bytes
    that stay on the device when the layer is offloaded (scales that are not parameters
    or buffers); ``transient_bytes(shape, rows, outliers, dtype)``: what the layer's
    forward allocates while it computes ``rows`` rows (above its output; ``outliers``:
    input columns an outlier path takes), None when nothing is decoded.
    ``decode_probe``: what calibration times for the seconds per weight decoding adds to
    a forward (None: nothing to decode). ``apply(model, leaves)``: store the named
    leaves of ``model`` so, in place. ``leaf_types``: the leaf modules it applies to;
    ``casts``: it stores a weight in another dtype in place (ruled out where
    ``model.dtype`` reads that weight). ``config``: the :class:`QuantConfig` a quantized
    format applies (``tightfit run --quant`` offers those formats).
    ``outlier_threshold``: for a format whose transient bytes depend on the data (the
    input columns at or above it), the threshold the planner observes them with.
    ``convert_bytes(shape, dtype)``: what converting one full-precision weight allocates
    above the stored result (scratch of the quantizer or the cast), the part of loading a
    checkpoint the planner must count; declared from the CPU allocator's peak while
    converting (tests/quant/test_catalogue_convert.py holds each format to it).
    """

    name: str
    rank: int
    noise: float
    stored_bytes: Callable[[Shape, torch.dtype], int]
    apply: Callable[[nn.Module, frozenset[str]], None]
    held_offloaded: Callable[[Shape, torch.dtype], int] = _nothing
    transient_bytes: Callable[[Shape, int, int, torch.dtype], int] | None = None
    decode_probe: Probe | None = None
    leaf_types: tuple[type[nn.Module], ...] = (nn.Linear,)
    casts: bool = False
    config: QuantConfig | None = None
    outlier_threshold: float | None = None
    convert_bytes: Callable[[Shape, torch.dtype], int] = _nothing

    def __post_init__(self) -> None:
        check_type("name", self.name, str)
        if not self.name or self.name != self.name.strip().lower() or "," in self.name:
            raise ValueError(
                f"name={self.name!r} is not accepted; accepted: a non-empty lower-case word without commas or spaces"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {self.rank!r}")
        if isinstance(self.noise, bool) or not isinstance(self.noise, (int, float)) or not 0 <= self.noise < math.inf:
            raise ValueError(f"noise must be a finite number >= 0, got {self.noise!r}")
        for name in ("stored_bytes", "apply", "held_offloaded", "convert_bytes"):
            if not callable(getattr(self, name)):
                raise TypeError(f"{name} must be callable, got {getattr(self, name)!r}")
        for name in ("transient_bytes", "decode_probe"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} must be callable or None, got {getattr(self, name)!r}")
        if (self.transient_bytes is None) != (self.decode_probe is None):
            raise ValueError(
                f"format {self.name!r}: transient_bytes and decode_probe go together (a format that decodes "
                f"has both) or not at all"
            )
        if (
            not isinstance(self.leaf_types, tuple)
            or not self.leaf_types
            or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in self.leaf_types)
        ):
            raise TypeError(f"leaf_types must be a non-empty tuple of nn.Module classes, got {self.leaf_types!r}")
        check_type("casts", self.casts, bool)
        if self.config is not None:
            check_type("config", self.config, QuantConfig)

    @property
    def decodes(self) -> bool:
        """Whether a forward decodes weights stored so (everything but ``keep``)."""
        return self.decode_probe is not None


# -- the formats tightfit ships ------------------------------------------------------------


def _keep_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _keep_apply(model: nn.Module, leaves: frozenset[str]) -> None:
    """Kept weights stay as they are."""


def _cast_leaves(model: nn.Module, leaves: frozenset[str], storage: str, dtype: torch.dtype, scale: str | None) -> None:
    """Store the named leaves' weights in ``dtype``, each computing in its own dtype. One
    casting call per leaf, each leaf its own root: a model whose other units were cast
    already (streamed in unit by unit) takes more; a weight that ``model.dtype`` reads is
    refused. A weight in a compute dtype no wider than ``dtype`` (a float16 one, for
    bfloat16) stays as it is: storing it so would save nothing and change its values
    (float16 in bfloat16 loses 3 bits of mantissa)."""
    chosen = [(name, module) for name, module in model.named_modules() if name in leaves]
    deciders = dtype_deciders(model)
    for name, module in chosen:
        if id(module.weight) in deciders:
            raise ValueError(f"{name}.weight is what model.dtype reads; {storage} storage would change that dtype")
    with _diffusers.within(model):  # a diffusers model's get_parameter_dtype sees the compute dtype
        for _, module in chosen:
            weight = module.weight.dtype
            # one already in ``dtype`` goes on: casting refuses a second application, and hooks
            # nothing on a weight stored as it computes
            if weight in COMPUTE_DTYPES and weight.itemsize <= dtype.itemsize and weight != dtype:
                continue
            apply_layerwise_casting(module, dtype, weight, granularity="model", skip=(), scale=scale)


def _bfloat16_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * min(dtype.itemsize, 2)  # a weight of 2 bytes or fewer stays as it is


def _bfloat16_apply(model: nn.Module, leaves: frozenset[str]) -> None:
    _cast_leaves(model, leaves, "bfloat16", torch.bfloat16, None)  # float32's range: no scale


def _bfloat16_decoded(shape: Shape, rows: int, outliers: int, dtype: torch.dtype) -> int:
    """A weight wider than 2 bytes is upcast to its dtype for each forward; one of 2 bytes
    or fewer stays as it is and decodes nothing."""
    return _decoded_copy(shape, rows, outliers, dtype) if dtype.itemsize > 2 else 0


def _bfloat16_convert_bytes(shape: Shape, dtype: torch.dtype) -> int:
    """The finite check of a weight it casts (``torch.isfinite``: a copy of its magnitudes
    and three boolean masks), which runs before the 2-byte result exists: its bytes less
    the result's; nothing where the weight stays as it is."""
    return math.prod(shape) * (dtype.itemsize + 3 - 2) if dtype.itemsize > 2 else 0


def _bfloat16_probe(linear: nn.Linear, x: torch.Tensor) -> tuple[Callable[[], Any], None]:
    """The casting hook's upcast of a weight stored in bfloat16."""
    stored = linear.weight.detach().to(torch.bfloat16)
    return (lambda: ops.cast(stored, torch.float32)), None


def _float8_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) + shape[0] * 4  # one byte a value, a power-of-two float32 scale per row


def _float8_apply(model: nn.Module, leaves: frozenset[str]) -> None:
    _cast_leaves(model, leaves, "float8", FLOAT8_DTYPE, "channel")


def _float8_convert_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * (dtype.itemsize + 2)  # the scaled copy in the compute dtype, and a half-width one


def _float8_probe(linear: nn.Linear, x: torch.Tensor) -> tuple[Callable[[], Any], None]:
    """The casting hook's upcast of a stored weight and its per-row scale."""
    stored = linear.weight.detach().to(FLOAT8_DTYPE)
    scale = torch.ones(stored.shape[0], 1, device=stored.device)
    return (lambda: ops.cast(stored, torch.float32).mul_(scale)), None


def quantized_format(
    name: str,
    rank: int,
    noise: float,
    config: QuantConfig,
    module: type[nn.Module],
    stored_bytes: Callable[[Shape, torch.dtype], int],
    *,
    held_offloaded: Callable[[Shape, torch.dtype], int] = _nothing,
    outlier_threshold: float | None = None,
    convert_bytes: Callable[[Shape, torch.dtype], int] = _nothing,
) -> StorageFormat:
    """A format whose layers (``module``) ``quantize_`` builds from ``config``: applied by
    quantizing the chosen ``nn.Linear`` leaves; its transient bytes are the ones
    ``module.transient_bytes`` counts for the forward it runs; its decode probe times
    ``dequantize`` of a layer that decodes its whole weight per call, else its forward
    against the full-precision one."""
    transient = getattr(module, "transient_bytes", None)
    if not callable(transient):
        raise TypeError(
            f"module {module!r} must have a transient_bytes(shape, rows, outliers, dtype) classmethod: the bytes "
            f"its forward allocates"
        )

    def apply(model: nn.Module, leaves: frozenset[str]) -> None:
        others = tuple(
            glob.escape(n) for n, leaf in model.named_modules() if type(leaf) is nn.Linear and n not in leaves
        )
        quantize_(model, replace(config, skip=others))

    def probe(linear: nn.Linear, x: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
        layer = handler_for(config)(linear, config)  # the handler alone: no progress bar named after a config
        if isinstance(layer, QuantizedLinear):
            return layer.dequantize, None
        return (lambda: layer(x)), (lambda: linear(x))

    return StorageFormat(
        name,
        rank,
        noise,
        stored_bytes,
        apply,
        held_offloaded,
        transient,
        probe,
        config=config,
        outlier_threshold=outlier_threshold,
        convert_bytes=convert_bytes,
    )


def _blockwise_bytes(
    bits: int, blocksize: int, map_size: int
) -> tuple[Callable[[Shape, torch.dtype], int], Callable[[Shape, torch.dtype], int]]:
    """Stored bytes (codes of ``bits`` bits, a float32 scale per block, the map of
    ``map_size`` float32 values) and those held when offloaded (the scales and the map:
    a QuantState is neither a parameter nor a buffer)."""

    def scales(shape: Shape, dtype: torch.dtype) -> int:
        return math.ceil(math.prod(shape) / blocksize) * 4 + map_size * 4

    def stored(shape: Shape, dtype: torch.dtype) -> int:
        return math.ceil(math.prod(shape) * bits / 8) + scales(shape, dtype)

    return stored, scales


def _blockwise_scratch(blocksize: int, table_bytes: int, floor: int) -> Callable[[Shape, torch.dtype], int]:
    """What quantizing a weight blockwise allocates above the stored result (the CPU
    allocator's peak), the largest of: ``floor`` (small weights: the kernel's own buffers);
    the finite check of the block scales (``torch.isfinite``: a float32 copy of their
    magnitudes and three boolean masks, 7 bytes a block); a float16 weight's float32 copy,
    which the kernels read (4 bytes a value). Both run before the state's copy of the code
    table (``table_bytes``) exists."""

    def scratch(shape: Shape, dtype: torch.dtype) -> int:
        numel = math.prod(shape)
        widened = 4 * numel if dtype == torch.float16 else 0
        return max(floor, 7 * math.ceil(numel / blocksize) - table_bytes, widened - table_bytes)

    return scratch


def _int8_convert_bytes(shape: Shape, dtype: torch.dtype) -> int:
    peak = _cpu_int8_rows.vectorwise_peak_bytes(shape[0], shape[1], 0)  # the numba kernel: its flags
    if peak is None:  # the reference: a float32 copy, the rounded codes, the outlier mask; the row scales
        return math.prod(shape) * 7 + shape[0] * 4
    return peak - _rows_bytes(shape, dtype)


def _rows_bytes(shape: Shape, dtype: torch.dtype) -> int:
    return math.prod(shape) + shape[0] * 4  # int8 codes, a float32 scale per row (a buffer: offloading moves it)


def _builtin() -> list[StorageFormat]:
    nf4, fp4, blockwise8, int8 = NF4Config(), FP4Config(), Blockwise8Config(), Int8Config()
    stored_4bit, held_4bit = _blockwise_bytes(4, nf4.blocksize, 16)
    scratch_4bit = _blockwise_scratch(nf4.blocksize, 16 * 4, 128)
    stored_8bit, held_8bit = _blockwise_bytes(8, blockwise8.blocksize, 256)
    return [
        StorageFormat("keep", 0, 0.0, _keep_bytes, _keep_apply, leaf_types=(nn.Linear, nn.Embedding)),
        StorageFormat(
            "bfloat16",
            1,
            0.0017,
            _bfloat16_bytes,
            _bfloat16_apply,
            transient_bytes=_bfloat16_decoded,
            decode_probe=_bfloat16_probe,
            leaf_types=(nn.Linear, nn.Embedding),
            casts=True,
            convert_bytes=_bfloat16_convert_bytes,
        ),
        StorageFormat(
            "float8",
            2,
            0.026,
            _float8_bytes,
            _float8_apply,
            transient_bytes=_decoded_copy,
            decode_probe=_float8_probe,
            leaf_types=(nn.Linear, nn.Embedding),
            casts=True,
            convert_bytes=_float8_convert_bytes,
        ),
        quantized_format(
            "8bit",
            2,
            0.013,
            blockwise8,
            Linear8bit,
            stored_8bit,
            held_offloaded=held_8bit,
            convert_bytes=_blockwise_scratch(blockwise8.blocksize, 256 * 4, 4096),
        ),
        quantized_format(
            "int8",
            2,
            0.011,
            int8,
            LinearInt8,
            _rows_bytes,
            outlier_threshold=int8.threshold,
            convert_bytes=_int8_convert_bytes,
        ),
        quantized_format(
            "nf4", 3, 0.092, nf4, Linear4bit, stored_4bit, held_offloaded=held_4bit, convert_bytes=scratch_4bit
        ),
        quantized_format(
            "fp4", 4, 0.122, fp4, Linear4bit, stored_4bit, held_offloaded=held_4bit, convert_bytes=scratch_4bit
        ),
    ]


# -- the registry ----------------------------------------------------------------------

_LOCK = threading.Lock()
_FORMATS: dict[str, StorageFormat] = {f.name: f for f in _builtin()}


def storage_formats() -> tuple[StorageFormat, ...]:
    """Every registered format, in the order the planner prefers them at equal predicted
    time and precision (the built-in ones, then the others as registered)."""
    return tuple(_FORMATS.values())


def storage_format(name: str) -> StorageFormat:
    """The format called ``name``; ValueError naming the accepted ones otherwise."""
    check_type("name", name, str)
    found = _FORMATS.get(name)
    if found is None:
        raise ValueError(f"storage format {name!r} is not registered; registered: {', '.join(_FORMATS)}")
    return found


def register_format(storage: StorageFormat) -> StorageFormat:
    """Add ``storage`` to the catalogue (a name registered already is refused); returns it."""
    check_type("storage", storage, StorageFormat)
    with _LOCK:
        if storage.name in _FORMATS:
            raise ValueError(
                f"storage format {storage.name!r} is registered already; unregister_format({storage.name!r}) first"
            )
        _FORMATS[storage.name] = storage
    return storage


def unregister_format(name: str) -> StorageFormat:
    """Remove the format called ``name`` from the catalogue (``keep`` stays: the planner
    must always be able to leave a weight as it is); returns it."""
    storage = storage_format(name)
    if name == "keep":
        raise ValueError(
            "storage format 'keep' cannot be unregistered: the planner must be able to leave a weight as it is"
        )
    with _LOCK:
        del _FORMATS[name]
    return storage
