"""The checks that keep the quantization kernels memory-safe (D9), one per op.

They run inside the op on every path (see ``_registry``), so the raw
``torch.ops.tightfit.*`` entry points are as safe as the public functions. They read
metadata only (shapes, dtypes, strides, devices, ints), never values, so they cost no
device synchronization and also run on the fake tensors of a trace. Each error names
the argument, the value received and what is accepted (D7).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tightfit._validate import check_choice, check_same_device, check_type
from tightfit.ops.codes import QUANT_TYPES_4BIT

__all__: list[str] = []

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The 8-bit blocksizes configs and checkpoints name (and the GPU quantize kernel tiles).
#: The 8-bit ops themselves take any blocksize up to MAX_BLOCKSIZE_8BIT, as bitsandbytes does.
BLOCKSIZES_8BIT = (64, 128, 256, 512, 1024, 2048, 4096)
BLOCKSIZES_4BIT = (32, *BLOCKSIZES_8BIT)
MAX_BLOCKSIZE_8BIT = 2**31 - 1
#: dtypes that packed 4-bit codes may be stored as (bitsandbytes' ``quant_storage``).
PACKED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, *FLOAT_DTYPES)


def block_count(numel: int, blocksize: int) -> int:
    """Blocks of ``blocksize`` covering ``numel`` values (the last may be partial)."""
    return -(-numel // blocksize)


def packed_bytes(numel: int) -> int:
    """Bytes that hold ``numel`` 4-bit codes, two per byte."""
    return (numel + 1) // 2


def check_float_input(name: str, A: object) -> torch.Tensor:
    check_type(name, A, torch.Tensor)
    check_choice(f"{name}.dtype", A.dtype, FLOAT_DTYPES)
    return A


def check_blocksize(blocksize: object, accepted: tuple[int, ...] | None) -> int:
    """One of ``accepted``, or with None any int from 1 to MAX_BLOCKSIZE_8BIT (8-bit blocks
    are scanned value by value, so no kernel needs a power of two)."""
    if isinstance(blocksize, bool) or not isinstance(blocksize, int):
        raise TypeError(f"blocksize must be int, got {type(blocksize).__name__}: {blocksize!r}")
    if accepted is not None:
        check_choice("blocksize", blocksize, accepted)
    elif not 1 <= blocksize <= MAX_BLOCKSIZE_8BIT:
        raise ValueError(f"blocksize={blocksize} is not accepted; accepted: an int from 1 to {MAX_BLOCKSIZE_8BIT}")
    return blocksize


def check_dtype(name: str, dtype: object) -> None:
    check_type(name, dtype, torch.dtype)
    check_choice(name, dtype, FLOAT_DTYPES)


def check_quant_type(quant_type: object) -> None:
    check_type("quant_type", quant_type, str)
    check_choice("quant_type", quant_type, QUANT_TYPES_4BIT)


def check_code(code: object, A: torch.Tensor) -> torch.Tensor:
    """The 8-bit code table: 256 float32 values, since codes are bytes that index it."""
    check_type("code", code, torch.Tensor)
    if code.dtype != torch.float32 or code.dim() != 1 or code.numel() != 256:
        raise ValueError(
            f"code must be a 1-D float32 tensor of 256 values, got dtype {code.dtype}, shape {tuple(code.shape)}"
        )
    check_same_device("code", code, "A", A)
    return code


def check_absmax(absmax: object, numel: int, blocksize: int, A: torch.Tensor) -> torch.Tensor:
    check_type("absmax", absmax, torch.Tensor)
    if absmax.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"absmax must be a floating-point tensor (float32, float16 or bfloat16), got dtype {absmax.dtype}"
        )
    expected = block_count(numel, blocksize)
    if absmax.dim() != 1 or absmax.numel() != expected:
        raise ValueError(
            f"absmax has shape {tuple(absmax.shape)}; {numel} values in blocks of {blocksize} need {expected} (1-D)"
        )
    check_same_device("absmax", absmax, "A", A)
    return absmax


def check_shape(shape: object, *, matrix: bool) -> list[int]:
    """A weight shape as a list of ints: any rank >= 0 with sizes >= 0, or (out, in) > 0."""
    if (
        isinstance(shape, (str, bytes))
        or not isinstance(shape, (list, tuple, torch.Size))
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise TypeError(f"shape must be a sequence of non-negative ints, got {type(shape).__name__}: {shape!r}")
    if matrix and (len(shape) != 2 or min(shape) == 0):
        raise ValueError(f"shape must be (out_features, in_features) with positive ints, got {list(shape)!r}")
    return list(shape)


def check_packed(name: str, packed: object, numel: int, shape: list[int]) -> torch.Tensor:
    """Packed 4-bit codes for ``numel`` values: contiguous (read in memory order), exactly their bytes."""
    check_type(name, packed, torch.Tensor)
    check_choice(f"{name}.dtype", packed.dtype, PACKED_DTYPES)
    have, need = packed.numel() * packed.element_size(), packed_bytes(numel)
    if have != need:
        raise ValueError(f"{name} holds {have} packed bytes but shape {tuple(shape)} needs {need}")
    if not packed.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (packed bytes are read in memory order), got strides {packed.stride()}"
        )
    return packed


def quantize_blockwise(A: Any, code: Any, blocksize: Any) -> None:
    check_float_input("A", A)
    check_blocksize(blocksize, None)
    check_code(code, A)


def dequantize_blockwise(A: Any, absmax: Any, code: Any, blocksize: Any, dtype: Any) -> None:
    check_type("A", A, torch.Tensor)
    if A.dtype != torch.uint8:
        raise TypeError(f"A must be uint8 codes, got dtype {A.dtype}")
    check_blocksize(blocksize, None)
    check_absmax(absmax, A.numel(), blocksize, A)
    check_code(code, A)
    check_dtype("dtype", dtype)


def quantize_4bit(A: Any, blocksize: Any, quant_type: Any, quant_storage: Any) -> None:
    check_float_input("A", A)
    check_blocksize(blocksize, BLOCKSIZES_4BIT)
    check_quant_type(quant_type)
    check_type("quant_storage", quant_storage, torch.dtype)
    check_choice("quant_storage", quant_storage, PACKED_DTYPES)
    nbytes = packed_bytes(A.numel())
    if nbytes % quant_storage.itemsize:
        raise ValueError(
            f"quant_storage={quant_storage} cannot hold {nbytes} packed bytes (itemsize {quant_storage.itemsize}); use torch.uint8"
        )


def dequantize_4bit(A: Any, absmax: Any, blocksize: Any, quant_type: Any, shape: Any, dtype: Any) -> None:
    check_blocksize(blocksize, BLOCKSIZES_4BIT)
    check_quant_type(quant_type)
    shape = check_shape(shape, matrix=False)
    numel = math.prod(shape)
    check_packed("A", A, numel, shape)
    check_absmax(absmax, numel, blocksize, A)
    check_dtype("dtype", dtype)


def check_scales(
    absmax: Any,
    numel: int,
    blocksize: int,
    A: torch.Tensor,
    absmax2: Any,
    code2: Any,
    nested_blocksize: Any,
    offset: Any,
) -> None:
    """Block scales as stored: float ``absmax``, or its uint8 codes with the nested
    ``absmax2`` (float32), ``code2`` (256 float32), ``nested_blocksize`` and ``offset``."""
    if absmax2 is None:
        if code2 is not None or offset is not None:
            raise ValueError(
                "code2 or offset is given without absmax2; double-quantized scales need all three, plain scales none"
            )
        check_absmax(absmax, numel, blocksize, A)
        return
    check_type("absmax", absmax, torch.Tensor)
    expected = block_count(numel, blocksize)
    if absmax.dtype != torch.uint8 or absmax.dim() != 1 or absmax.numel() != expected:
        raise ValueError(
            f"absmax (double-quantized) must be 1-D uint8 codes, {expected} for {numel} values in blocks of "
            f"{blocksize}; got dtype {absmax.dtype}, shape {tuple(absmax.shape)}"
        )
    check_same_device("absmax", absmax, "A", A)
    check_blocksize(nested_blocksize, None)
    check_type("absmax2", absmax2, torch.Tensor)
    nested = block_count(expected, nested_blocksize)
    if absmax2.dtype != torch.float32 or absmax2.dim() != 1 or absmax2.numel() != nested:
        raise ValueError(
            f"absmax2 must be 1-D float32 with {nested} values ({expected} codes in blocks of {nested_blocksize}); "
            f"got dtype {absmax2.dtype}, shape {tuple(absmax2.shape)}"
        )
    check_same_device("absmax2", absmax2, "A", A)
    check_type("code2", code2, torch.Tensor)
    if code2.dtype != torch.float32 or code2.dim() != 1 or code2.numel() != 256:
        raise ValueError(
            f"code2 must be 1-D float32 of 256 values, got dtype {code2.dtype}, shape {tuple(code2.shape)}"
        )
    check_same_device("code2", code2, "A", A)
    check_type("offset", offset, torch.Tensor)
    if offset.dtype != torch.float32 or offset.numel() != 1:
        raise ValueError(
            f"offset must be a float32 tensor of one value, got dtype {offset.dtype}, shape {tuple(offset.shape)}"
        )
    check_same_device("offset", offset, "A", A)


def gemv_4bit(
    A: Any,
    B: Any,
    shape: Any,
    absmax: Any,
    blocksize: Any,
    quant_type: Any,
    absmax2: Any = None,
    code2: Any = None,
    nested_blocksize: Any = 256,
    offset: Any = None,
) -> None:
    check_float_input("A", A)
    check_blocksize(blocksize, BLOCKSIZES_4BIT)
    check_quant_type(quant_type)
    shape = check_shape(shape, matrix=True)
    if A.dim() < 1 or A.shape[-1] != shape[1]:
        raise ValueError(
            f"A has shape {tuple(A.shape)}; its last dimension must be the weight's in_features, {shape[1]}"
        )
    check_packed("B", B, shape[0] * shape[1], shape)
    check_same_device("B", B, "A", A)
    check_scales(absmax, shape[0] * shape[1], blocksize, A, absmax2, code2, nested_blocksize, offset)


def gemv_blockwise(
    A: Any,
    B: Any,
    absmax: Any,
    code: Any,
    blocksize: Any,
    absmax2: Any = None,
    code2: Any = None,
    nested_blocksize: Any = 256,
    offset: Any = None,
) -> None:
    check_float_input("A", A)
    check_type("B", B, torch.Tensor)
    if B.dtype != torch.uint8 or B.dim() != 2:
        raise TypeError(
            f"B must be 2-D uint8 codes (out_features x in_features), got {B.dtype} of shape {tuple(B.shape)}"
        )
    if not B.is_contiguous():
        raise ValueError(f"B must be contiguous (codes are read in memory order), got strides {B.stride()}")
    if A.dim() < 1 or A.shape[-1] != B.shape[1]:
        raise ValueError(f"A has shape {tuple(A.shape)}; its last dimension must be B's in_features, {B.shape[1]}")
    check_same_device("B", B, "A", A)
    check_blocksize(blocksize, None)
    check_scales(absmax, B.numel(), blocksize, A, absmax2, code2, nested_blocksize, offset)
    check_code(code, A)
