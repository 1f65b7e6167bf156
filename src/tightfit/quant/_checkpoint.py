"""Checks on quantized weights read from a checkpoint (D9).

A checkpoint is data from outside: each entry is checked when it is read, and an
error names the key, the value received and what is accepted (ValueError or
TypeError), so a damaged or foreign file is refused instead of decoding to garbage.
Private to ``tightfit.quant``: ``QuantState.from_dict`` and the modules'
``load_state_dict`` are the public ways in.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tightfit._files import parse_json
from tightfit._validate import check_choice, check_type
from tightfit.ops._arg_checks import BLOCKSIZES_4BIT, BLOCKSIZES_8BIT, block_count, check_packed
from tightfit.ops.codes import QUANT_TYPES_4BIT, code_4bit

__all__: list[str] = []  # private helpers

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: the packed entry's name (after "quant_state.") and the quant_type it stands for.
PACKED_NAMES = {"bitsandbytes__nf4": "nf4", "bitsandbytes__fp4": "fp4", "tightfit__blockwise8": None}
_TENSOR_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_METADATA_KEYS = ("quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset")
_NESTED_KEYS = ("nested_absmax", "nested_quant_map", "nested_blocksize", "nested_dtype", "nested_offset")
_REQUIRED_KEYS = ("absmax", "quant_map", "blocksize", "dtype")
#: the JSON bitsandbytes writes is about 200 bytes; far more is not metadata.
_MAX_METADATA_BYTES = 1 << 16


def dense_tensor(name: str, value: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A strided tensor holding data (not meta), of ``dtype`` when given."""
    check_type(name, value, torch.Tensor)
    if value.layout != torch.strided or value.is_meta:
        raise ValueError(f"{name} must be a dense tensor holding data, got layout {value.layout} on {value.device}")
    if dtype is not None and value.dtype != dtype:
        raise TypeError(f"{name} has dtype {value.dtype}; accepted: {dtype}")
    return value


def exact_tensor(name: str, value: object, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A dense tensor of exactly ``dtype`` and ``shape``."""
    tensor = dense_tensor(name, value, dtype)
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; accepted: {tuple(shape)}")
    return tensor


def scales(name: str, value: object, count: int | None = None) -> torch.Tensor:
    """A 1-D float32 tensor of finite values >= 0 (``count`` of them when given): per-block
    or per-row scales, which no valid writer leaves negative, NaN or inf."""
    tensor = dense_tensor(name, value, torch.float32)
    if tensor.dim() != 1 or (count is not None and tensor.numel() != count):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; accepted: ({'n' if count is None else count},)")
    bad = ~(torch.isfinite(tensor) & (tensor >= 0))
    if bool(bad.any()):
        index = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{index}] is {float(tensor[index])}; accepted: finite scales >= 0")
    return tensor


def _code_table(name: str, value: object, quant_type: str | None) -> torch.Tensor:
    """4-bit: exactly the table of ``quant_type`` (decoding uses the type, so another
    table would be silently ignored); 8-bit: 256 finite values, sorted ascending."""
    tensor = dense_tensor(name, value, torch.float32)
    if quant_type is not None:
        if tensor.shape != (16,) or not torch.equal(tensor.cpu(), code_4bit(quant_type)):
            raise ValueError(
                f"{name} (shape {tuple(tensor.shape)}) is not the {quant_type} table; accepted: the 16 values of {quant_type}"
            )
        return tensor
    if tensor.shape != (256,):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; accepted: (256,), an 8-bit code table")
    if not bool(torch.isfinite(tensor).all()) or not bool((tensor[1:] >= tensor[:-1]).all()):
        raise ValueError(f"{name} has NaN, inf or unsorted values; accepted: 256 finite values sorted ascending")
    return tensor


def _int_choice(name: str, value: object, accepted: tuple[int, ...]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be int, got {type(value).__name__}: {value!r:.80}")
    check_choice(name, value, accepted)
    return value


def _dtype(name: str, value: object) -> torch.dtype:
    check_type(name, value, str)
    check_choice(name, value, DTYPES_BY_NAME)
    return DTYPES_BY_NAME[value]


def _shape(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}: {value!r:.80}")
    if any(d < 0 for d in value):
        raise ValueError(f"{name}={list(value)!r:.80} has a negative size; accepted: sizes >= 0")
    return tuple(value)


def _offset(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r:.80}")
    if not 0.0 <= value <= torch.finfo(torch.float32).max:  # compared exactly, so a huge int never overflows
        raise ValueError(
            f"{name}={value!r:.80} is not accepted; accepted: a finite float32 number >= 0 (the mean of the scales)"
        )
    return float(value)


def _unpack(key: str, blob: object) -> dict[str, Any]:
    """The metadata held by a packed entry: UTF-8 JSON of one object, in a 1-D uint8 tensor."""
    tensor = dense_tensor(key, blob, torch.uint8)
    if tensor.dim() != 1 or tensor.numel() > _MAX_METADATA_BYTES:
        raise ValueError(
            f"{key} has shape {tuple(tensor.shape)}; accepted: 1-D, at most {_MAX_METADATA_BYTES} bytes of JSON"
        )
    metadata = parse_json(bytes(tensor.cpu().tolist()), key, what="does not hold valid UTF-8 JSON")
    if not isinstance(metadata, dict):
        raise ValueError(f"{key} holds JSON {type(metadata).__name__}; accepted: a JSON object")
    return metadata


def _collect(items: dict) -> tuple[dict[str, Any], dict[str, str], str | None]:
    """Entries by field name (prefixes dropped, the packed JSON opened), where each came
    from (for messages), and the packed entry's key if there is one."""
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}
    packed_key = None
    for key, value in items.items():
        check_type("quant state key", key, str)
        name = key.split(".")[-1]
        if name.startswith(("bitsandbytes__", "tightfit__")):
            check_choice(f"{key} (packed entry name)", name, PACKED_NAMES)
            if packed_key is not None:
                raise ValueError(f"expected at most one packed quant_state entry, found {packed_key!r} and {key!r}")
            packed_key = key
            given = [(f"{key}[{field!r}]", field, item) for field, item in _unpack(key, value).items()]
        else:
            given = [(key, name, value)]
        for source, field, item in given:
            if field not in _TENSOR_KEYS and field not in _METADATA_KEYS:
                raise ValueError(
                    f"{source} is not a quant state entry; accepted: {', '.join(_TENSOR_KEYS + _METADATA_KEYS)}"
                )
            if field in fields:
                raise ValueError(f"{source} is given twice (also as {sources[field]}); a quant state has one of each")
            fields[field], sources[field] = item, source
    if packed_key is not None and "quant_type" not in fields:
        fields["quant_type"], sources["quant_type"] = PACKED_NAMES[packed_key.split(".")[-1]], packed_key
    return fields, sources, packed_key


def read_quant_state(items: object) -> dict[str, Any]:
    """The checked fields of a serialized QuantState (what ``as_dict`` writes, packed or
    not, keys with or without prefixes): tensors as given, metadata as torch types."""
    check_type("items", items, dict)
    fields, sources, packed_key = _collect(items)
    missing = [key for key in _REQUIRED_KEYS if key not in fields]
    if missing:
        raise ValueError(f"quant state is missing {missing}; found {sorted(sources.values())}")
    quant_type = fields.get("quant_type")
    if quant_type is not None:
        check_type(sources["quant_type"], quant_type, str)
        check_choice(sources["quant_type"], quant_type, QUANT_TYPES_4BIT)
    if packed_key is not None and quant_type != PACKED_NAMES[packed_key.split(".")[-1]]:
        raise ValueError(f"{sources['quant_type']} is quant_type={quant_type!r} but the packed entry is {packed_key!r}")
    checked: dict[str, Any] = {
        "quant_type": quant_type,
        "blocksize": _int_choice(
            sources["blocksize"], fields["blocksize"], BLOCKSIZES_4BIT if quant_type else BLOCKSIZES_8BIT
        ),
        "dtype": _dtype(sources["dtype"], fields["dtype"]),
        "shape": None if fields.get("shape") is None else _shape(sources["shape"], fields["shape"]),
        "quant_map": _code_table(sources["quant_map"], fields["quant_map"], quant_type),
    }
    if quant_type is not None and checked["shape"] is None:
        raise ValueError(
            f"{sources.get('shape', 'shape')} is missing or null; a 4-bit state needs the shape it decodes to"
        )
    nested = [key for key in _NESTED_KEYS if key in fields]
    if nested and len(nested) != len(_NESTED_KEYS):
        raise ValueError(
            f"double-quantization entries come together; found {nested}, missing {[k for k in _NESTED_KEYS if k not in fields]}"
        )
    count = None if checked["shape"] is None else block_count(math.prod(checked["shape"]), checked["blocksize"])
    if nested:
        absmax = dense_tensor(sources["absmax"], fields["absmax"], torch.uint8)
        if absmax.dim() != 1 or (count is not None and absmax.numel() != count):
            raise ValueError(
                f"{sources['absmax']} has shape {tuple(absmax.shape)}; accepted: ({'n' if count is None else count},)"
            )
        nested_blocksize = _int_choice(sources["nested_blocksize"], fields["nested_blocksize"], BLOCKSIZES_8BIT)
        checked.update(
            absmax=absmax,
            nested_absmax=scales(
                sources["nested_absmax"], fields["nested_absmax"], block_count(absmax.numel(), nested_blocksize)
            ),
            nested_quant_map=_code_table(sources["nested_quant_map"], fields["nested_quant_map"], None),
            nested_blocksize=nested_blocksize,
            nested_dtype=_dtype(sources["nested_dtype"], fields["nested_dtype"]),
            nested_offset=_offset(sources["nested_offset"], fields["nested_offset"]),
        )
    else:
        checked["absmax"] = scales(sources["absmax"], fields["absmax"], count)
    return checked


def packed_4bit(name: str, value: object, shape: tuple[int, ...]) -> torch.Tensor:
    """Packed 4-bit codes for a weight of ``shape``, in any storage dtype the ops take
    (bitsandbytes' ``quant_storage``), the byte count exact; returned contiguous."""
    return check_packed(name, dense_tensor(name, value).contiguous(), math.prod(shape), list(shape))


def bias(name: str, value: object, current: torch.Tensor) -> torch.Tensor:
    """A floating-point bias shaped like the module's (copied into its dtype)."""
    tensor = dense_tensor(name, value)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} has dtype {tensor.dtype}; accepted: a floating-point dtype")
    if tensor.shape != current.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; accepted: {tuple(current.shape)}")
    return tensor


def weight_format(name: str, value: object) -> None:
    """bitsandbytes' ``Linear8bitLt`` writes ``weight_format`` 0: its weight is row-major,
    the only layout read here."""
    tensor = dense_tensor(name, value)
    if tensor.numel() != 1 or tensor.is_complex() or tensor.dtype == torch.bool or float(tensor.reshape(())) != 0:
        raise ValueError(
            f"{name} must be one number, 0 (row-major, what bitsandbytes writes); got {tensor.dtype} shape {tuple(tensor.shape)}"
        )
