"""Fast CPU kernels for blockwise 8-bit and 4-bit quantization (numba, compiled at first use
and cached on disk; the kernels themselves are in ``_kernels_blockwise``). Decoding runs the
native kernel (``native/dequantize_blockwise.c``) where it builds: it shares torch's OpenMP
threads, where each numba call handed over between two thread pools (milliseconds a call
under the default spin-wait, paid per tile by the many-token forwards).

They follow the reference kernels in ``ops/blockwise.py`` operation for operation in
float32 (reciprocal-multiply for full blocks, division for the partial last block, the
same clamps), so codes and absmax are bit-identical. Each block is read twice: once for
its absmax, once to scale and code every value. The nearest code is found exactly with
one table load: floats are mapped to order-preserving 32-bit keys, and a table indexed
by a key's top 16 bits holds the codes on either side of the one decision boundary that
bucket can contain, with the boundary's low 16 bits (a short scan over the boundaries
covers unusual codes whose buckets hold several). Decoding multiplies ``code * absmax``
per value as the reference does; 4-bit codes are read a byte at a time through a table
of code pairs.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from tightfit.ops._arg_checks import block_count
from tightfit.ops._cpu_gemv import native_library
from tightfit.ops._hugepages import empty_with_huge_pages
from tightfit.ops._numba import kernel_lock, usable_numba

__all__: list[str] = []

_NO_PAIRS = np.empty(0, np.uint64)  # 8-bit decoding reads codes a byte each


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The decision boundaries between neighbouring entries of a sorted code (float32)."""
    return (code[:-1] + code[1:]) / 2


def _order_keys(values: np.ndarray) -> np.ndarray:
    """32-bit keys (held in uint64) whose order is the float32 order; a bound of -0 takes
    +0's key, so values of either zero compare with it as floats do."""
    bits = np.where(values == 0, np.float32(0), values).astype(np.float32).view(np.uint32)
    return (bits ^ np.where(bits >> 31 != 0, np.uint32(0xFFFFFFFF), np.uint32(0x80000000))).astype(np.uint64)


@functools.lru_cache(maxsize=16)
def _search_table(bounds_bytes: bytes, order_bytes: bytes) -> tuple[np.ndarray, np.ndarray, bool]:
    """(bounds + inf, table, single_step) for finding codes from a float32's key.

    table[h] describes the values whose key has top 16 bits h: t bounds lie below all of
    them, and the entry is ``threshold | order[t] << 16 | order[t + 1] << 24``, where
    threshold is the low 16 bits of the key of the bound if exactly one falls in this
    bucket (a value above it takes order[t + 1]), else 0xFFFF. When no bucket holds more
    than one bound (true for the dynamic map, NF4 and FP4) that is the whole search;
    otherwise the kernel scans ``bounds`` on from t (8-bit codes only: identity order).
    """
    bounds = np.frombuffer(bounds_bytes, dtype=np.float32)
    order = np.frombuffer(order_bytes, dtype=np.uint8).astype(np.uint32)
    keys = _order_keys(bounds)
    bucket = np.arange(1 << 16, dtype=np.uint64)
    below = np.searchsorted(keys, bucket << 16, side="left")
    below_next = np.searchsorted(keys, (bucket + 1) << 16, side="left")
    single_step = bool((below_next - below).max() <= 1)
    next_key = np.append(keys, np.uint64(1 << 32))[below]
    threshold = np.where(below_next - below == 1, next_key & 0xFFFF, 0xFFFF).astype(np.uint32)
    above = order[np.minimum(below + 1, order.size - 1)]
    table = threshold | (order[below] << 16) | (above << 24)
    padded = np.append(bounds, np.float32(np.inf)).astype(np.float32)
    return padded, table.astype(np.uint32), single_step


@functools.lru_cache(maxsize=4)
def _pair_table(code_bytes: bytes) -> np.ndarray:
    """For each packed byte, its two decoded 4-bit codes: the high nibble's float32 bits in
    the low half of a uint64, the low nibble's in the high half (one load per byte)."""
    bits = np.frombuffer(code_bytes, dtype=np.uint32).astype(np.uint64)
    byte = np.arange(256)
    return bits[byte >> 4] | (bits[byte & 15] << np.uint64(32))


def _kernels():
    """The compiled kernels (``_kernels_blockwise``), imported at first use: it imports numba."""
    from tightfit.ops import _kernels_blockwise

    return _kernels_blockwise


def search_table(code_sorted: torch.Tensor, order: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """The search table for a sorted code; ``order`` maps sorted positions to codes (identity if None)."""
    positions = np.arange(code_sorted.numel(), dtype=np.uint8) if order is None else order.to(torch.uint8).numpy()
    return _search_table(midpoints(code_sorted).contiguous().numpy().tobytes(), positions.tobytes())


def _float_bits(A: torch.Tensor) -> np.ndarray:
    """A's values as the raw bits the kernel widens: bf16 as uint16, anything else as float32 (uint32)."""
    flat = A.reshape(-1)
    if A.dtype == torch.bfloat16:
        return flat.contiguous().view(torch.int16).numpy().view(np.uint16)
    return flat.float().contiguous().view(torch.int32).numpy().view(np.uint32)


def quantize_cpu(
    op: str, A: torch.Tensor, blocksize: int, sorted_code: torch.Tensor, order: torch.Tensor | None, reference
):
    """8-bit codes shaped like ``A`` (``order`` None) or packed 4-bit codes mapped through ``order``; and absmax."""
    if usable_numba(op, "running the reference kernel") is None:
        return reference()
    four_bit = order is not None
    out = empty_with_huge_pages(((A.numel() + 1) // 2,) if four_bit else A.shape, torch.uint8)
    absmax = torch.empty(block_count(A.numel(), blocksize), dtype=torch.float32)
    bounds, table, single_step = search_table(sorted_code, order)
    if four_bit and not single_step:
        raise ValueError("internal: a 4-bit code reached quantize_cpu with several bounds in one search bucket")
    with kernel_lock:
        _kernels().quantize(
            _float_bits(A),
            A.numel(),
            blocksize,
            table,
            bounds,
            single_step,
            four_bit,
            out.view(-1).numpy(),
            absmax.numpy(),
        )
    return out, absmax


def _dequantize_into(
    op: str,
    data: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    blocksize: int,
    numel: int,
    dtype: torch.dtype,
    reference,
) -> torch.Tensor:
    as_bf16 = dtype == torch.bfloat16
    library = native_library(op)
    if library is not None:
        out = empty_with_huge_pages((numel,), torch.bfloat16 if as_bf16 else torch.float32)
        scales, table = absmax.float().contiguous(), code.float().contiguous()
        bits = 4 if op == "dequantize_4bit" else 8
        library.tf_dequantize_blockwise(
            data.data_ptr(),
            bits,
            scales.data_ptr(),
            table.data_ptr(),
            numel,
            blocksize,
            out.data_ptr(),
            as_bf16,
            torch.get_num_threads(),
        )
        return out if out.dtype == dtype else out.to(dtype)
    if usable_numba(op, "running the reference kernel") is None:
        return reference()
    out = empty_with_huge_pages((numel,), torch.bfloat16 if as_bf16 else torch.float32)
    target = out.view(torch.int16).numpy().view(np.uint16) if as_bf16 else out.view(torch.int32).numpy().view(np.uint32)
    code32 = code.float().contiguous().numpy()
    pairs = _pair_table(code32.tobytes()) if op == "dequantize_4bit" else _NO_PAIRS
    with kernel_lock:
        _kernels().dequantize(
            data.numpy(), absmax.float().contiguous().numpy(), code32, pairs, blocksize, numel, target
        )
    return out if out.dtype == dtype else out.to(dtype)


def dequantize_8bit_cpu(A, absmax, code, blocksize, dtype, reference) -> torch.Tensor:
    out = _dequantize_into(
        "dequantize_blockwise", A.reshape(-1).contiguous(), absmax, code, blocksize, A.numel(), dtype, reference
    )
    return out.reshape(A.shape)


def dequantize_4bit_cpu(A, absmax, code, blocksize, shape, dtype, reference) -> torch.Tensor:
    numel = math.prod(shape)
    out = _dequantize_into(
        "dequantize_4bit",
        A.reshape(-1).view(torch.uint8).contiguous(),
        absmax,
        code,
        blocksize,
        numel,
        dtype,
        reference,
    )
    return out.reshape(shape)


def gemv_4bit_cpu(A, B, shape, absmax, code, blocksize, reference) -> torch.Tensor:
    if usable_numba("gemv_4bit", "running the reference kernel") is None:
        return reference()
    rows, cols = shape
    x = A.reshape(-1, cols).float().contiguous()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    code32 = code.float().contiguous().numpy()
    with kernel_lock:
        _kernels().gemv_4bit(
            x.view(-1).numpy(),
            B.reshape(-1).view(torch.uint8).contiguous().numpy(),
            absmax.float().contiguous().numpy(),
            code32,
            _pair_table(code32.tobytes()),
            blocksize,
            cols,
            out.numpy(),
        )
    return out.to(A.dtype).reshape(*A.shape[:-1], rows)
