"""LLM.int8()'s row-wise steps on the CPU, one numba pass per row each, bit-identical to
the reference kernels in :mod:`tightfit.ops.int8`.

The reference builds several full-size temporaries per call (the masked input, its
absolute values, the scaled product, the outer product of the scales); these kernels
read their input once (a row stays in cache between the two sweeps of the quantizer)
and write only the result, allocating next to nothing besides their outputs (see
:func:`vectorwise_peak_bytes`, the planner's figure). 16-bit values are widened and
rounded bit by bit, as torch rounds: numba has no float16 type.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tightfit.ops._numba import kernel_lock, load_numba, usable_numba

__all__: list[str] = []

#: Elements below which one thread runs an op (a pass over 2**18 float32 takes about 0.1 ms):
#: a parallel region waits for every thread, a scheduler slice (milliseconds) where another
#: process holds a core, which only a larger op repays.
PARALLEL_MIN = 1 << 18


# The two helpers below are typed per dtype by numba's overload (in _kernels); never called from Python.
def _widen(bits):
    """The float32 value of a float32's bits (uint32), a bfloat16's (uint16) or a float16's (int16)."""


def _store(out, r, c, value):
    """``out[r, c] = value`` rounded half to even to ``out``'s float32 (float32), bfloat16
    (uint16) or float16 (int16) bits, as torch rounds."""


@functools.lru_cache(maxsize=1)
def _kernels():
    numba, _ = load_numba()
    from numba import types
    from numba.extending import overload

    @numba.njit(inline="always")
    def as_float(bits):
        return np.uint32(bits).view(np.float32)

    @numba.njit(inline="always")
    def bits_of(value):
        return np.float32(value).view(np.uint32)

    @numba.njit(inline="always")
    def where(condition, a, b):
        """``a if condition else b`` for uint32, without a branch (so loops vectorize)."""
        mask = np.uint32(0) - np.uint32(condition)
        return (np.uint32(a) & mask) | (np.uint32(b) & ~mask)

    def half_to_float(bits):
        word = np.uint32(np.uint16(bits))
        exponent = (word >> np.uint32(10)) & np.uint32(0x1F)
        mantissa = word & np.uint32(0x3FF)
        subnormal = bits_of(np.float32(mantissa) * np.float32(5.9604644775390625e-08))  # mantissa * 2**-24, exact
        normal = ((exponent + np.uint32(112)) << np.uint32(23)) | (mantissa << np.uint32(13))
        special = np.uint32(0x7F800000) | (mantissa << np.uint32(13))  # inf, NaN
        size = where(exponent == 0, subnormal, where(exponent == 0x1F, special, normal))
        return as_float(size | ((word & np.uint32(0x8000)) << np.uint32(16)))

    @overload(_widen)
    def _widen_overload(bits):
        if bits == types.uint32:
            return lambda bits: as_float(bits)
        if bits == types.uint16:
            return lambda bits: as_float(np.uint32(bits) << np.uint32(16))
        return half_to_float

    def float_to_bfloat16(out, r, c, value):
        word = bits_of(value)
        rounded = np.uint32(word + np.uint32(0x7FFF) + ((word >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        out[r, c] = np.uint16(where(value != value, 0x7FC0, rounded))

    def float_to_half(out, r, c, value):
        word = bits_of(value)
        size = word & np.uint32(0x7FFFFFFF)
        # below 2**-14: adding 0.5 aligns a subnormal's bits, rounding as float32 adds
        subnormal = bits_of(as_float(size) + np.float32(0.5)) - np.uint32(0x3F000000)
        # a carry out of the mantissa rounds up to inf
        normal = np.uint32(size + np.uint32(0xC8000FFF) + ((size >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        past = where(size > np.uint32(0x7F800000), 0x7E00, 0x7C00)  # NaN, or 2**16 and past
        half = where(size >= np.uint32(0x47800000), past, where(size < np.uint32(0x38800000), subnormal, normal))
        out[r, c] = np.int16(np.uint16(half | ((word >> np.uint32(16)) & np.uint32(0x8000))))

    def store_float(out, r, c, value):
        out[r, c] = value

    @overload(_store)
    def _store_overload(out, r, c, value):
        if out.dtype == types.float32:
            return store_float
        return float_to_bfloat16 if out.dtype == types.uint16 else float_to_half

    @numba.njit(nogil=True)
    def quant_row(row, limit_bits, q, outlier):
        """``row``'s scale (the largest |x| below the limit), its codes written to ``q``:
        round(x * (127 / scale)) half to even, outliers coded 0 and their columns flagged
        (every flag written is 1, so rows racing on one are harmless); NaN where the row
        holds NaN or inf, nothing written then. Magnitudes are compared as the integers
        their float32 bits are (the same order for finite values), which vectorizes."""
        largest = np.uint32(0)  # below the limit
        any_size = np.uint32(0)  # of all: inf and NaN are past 0x7F800000
        for k in range(row.shape[0]):
            size = bits_of(_widen(row[k])) & np.uint32(0x7FFFFFFF)
            any_size = max(any_size, size)
            largest = max(largest, size if size < limit_bits else np.uint32(0))
        if any_size >= np.uint32(0x7F800000):
            return np.float32(np.nan)
        stat = as_float(largest)
        scale = np.float32(127.0) / stat if largest > 0 else np.float32(0.0)
        # adding and taking 1.5 * 2**23 rounds |x| <= 128 half to even
        if any_size < limit_bits:
            for k in range(row.shape[0]):
                q[k] = np.int8((_widen(row[k]) * scale + np.float32(12582912.0)) - np.float32(12582912.0))
            return stat
        for k in range(row.shape[0]):
            value = _widen(row[k])
            if bits_of(value) & np.uint32(0x7FFFFFFF) < limit_bits:
                q[k] = np.int8((value * scale + np.float32(12582912.0)) - np.float32(12582912.0))
            else:
                q[k] = 0
                outlier[k] = 1
        return stat

    @numba.njit(nogil=True)
    def quant_rows(bits, limit, q, row_stats, outlier, bad, start, stop):
        """Rows ``start`` to ``stop`` by ``quant_row``; a row holding NaN or inf is only flagged in ``bad``."""
        limit_bits = bits_of(limit)
        for r in range(start, stop):
            stat = quant_row(bits[r], limit_bits, q[r], outlier)
            if np.isnan(stat):
                bad[r] = 1
            else:
                row_stats[r] = stat

    @numba.njit(nogil=True)
    def zero_outlier_columns(q, outlier, start, stop):
        for r in range(start, stop):
            for k in range(q.shape[1]):
                if outlier[k]:
                    q[r, k] = 0

    @numba.njit(nogil=True)
    def dequant_rows(product, row_stats, col_stats, scale, bias, out, start, stop):
        """out = float32(product) * (row_stats * col_stats) * scale (+ bias), in that order in
        float32, then rounded to the output's type."""
        for r in range(start, stop):
            if bias.shape[0] == 0:
                for c in range(product.shape[1]):
                    _store(out, r, c, np.float32(product[r, c]) * (row_stats[r] * col_stats[c]) * scale)
            else:
                for c in range(product.shape[1]):
                    _store(
                        out, r, c, np.float32(product[r, c]) * (row_stats[r] * col_stats[c]) * scale + _widen(bias[c])
                    )

    # Each op in two drivers (numba caches one build per function): one thread, or one
    # parallel region of ``pieces`` row ranges.
    @numba.njit(nogil=True, cache=True)
    def vectorwise_quant(bits, limit, q, row_stats, outlier, bad, pieces):
        quant_rows(bits, limit, q, row_stats, outlier, bad, 0, bits.shape[0])
        if outlier.any():
            zero_outlier_columns(q, outlier, 0, bits.shape[0])

    @numba.njit(parallel=True, nogil=True, cache=True)
    def vectorwise_quant_parallel(bits, limit, q, row_stats, outlier, bad, pieces):
        rows = bits.shape[0]
        for p in numba.prange(pieces):
            quant_rows(bits, limit, q, row_stats, outlier, bad, p * rows // pieces, (p + 1) * rows // pieces)
        if outlier.any():
            for p in numba.prange(pieces):
                zero_outlier_columns(q, outlier, p * rows // pieces, (p + 1) * rows // pieces)

    @numba.njit(nogil=True, cache=True)
    def mm_dequant(product, row_stats, col_stats, scale, bias, out, pieces):
        dequant_rows(product, row_stats, col_stats, scale, bias, out, 0, product.shape[0])

    @numba.njit(parallel=True, nogil=True, cache=True)
    def mm_dequant_parallel(product, row_stats, col_stats, scale, bias, out, pieces):
        rows = product.shape[0]
        for p in numba.prange(pieces):
            dequant_rows(product, row_stats, col_stats, scale, bias, out, p * rows // pieces, (p + 1) * rows // pieces)

    return {
        (False, "quant"): vectorwise_quant,
        (True, "quant"): vectorwise_quant_parallel,
        (False, "dequant"): mm_dequant,
        (True, "dequant"): mm_dequant_parallel,
    }


def _kernel(op: str, rows: int, cols: int, numba):
    """The op's driver and its piece count: one thread below ``PARALLEL_MIN`` elements."""
    threads = numba.get_num_threads()
    parallel = threads > 1 and rows > 1 and rows * cols >= PARALLEL_MIN
    return _kernels()[parallel, op], min(threads, rows) if parallel else 1


def _as_bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous float tensor's bytes as the kernels read and write them: float32 as
    uint32 (or float32 for output), bfloat16 as uint16, float16 as int16."""
    array = tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int16).numpy()
    if tensor.dtype == torch.float16:
        return array
    return array.view(np.uint32 if tensor.dtype == torch.float32 else np.uint16)


def vectorwise_peak_bytes(rows: int, cols: int, outliers: int) -> int | None:
    """Bytes :func:`vectorwise_quant_cpu` holds at its peak for finite contiguous input,
    its outputs included: the codes, the row scales, the column and row flags, then the
    outlier indices (or, with none, the test of the row flags). None without numba, where
    the reference runs. :func:`mm_dequant_cpu` allocates nothing besides its output."""
    if load_numba()[0] is None:
        return None
    return rows * cols + 5 * rows + cols + max(1, 8 * outliers)


def vectorwise_quant_cpu(rows: torch.Tensor, threshold: float, reference):
    """``reference()``'s (q, row_stats, outlier_cols) for non-empty (rows, K) ``rows``; with
    NaN or inf in it, or without numba, ``reference()`` itself."""
    numba = usable_numba("int8_vectorwise_quant", "running the reference kernel")
    if numba is None:
        return reference()
    rows = rows.contiguous()
    # torch compares with the threshold in A's dtype; past its range there are no outliers
    limit = float(torch.tensor(threshold, dtype=rows.dtype).float()) if threshold > 0.0 else float("inf")
    q = torch.empty(rows.shape, dtype=torch.int8)
    row_stats = torch.empty(rows.shape[0], dtype=torch.float32)
    outlier = torch.zeros(rows.shape[1], dtype=torch.uint8)
    bad = torch.zeros(rows.shape[0], dtype=torch.uint8)
    kernel, pieces = _kernel("quant", *rows.shape, numba)
    with kernel_lock:
        kernel(_as_bits(rows), np.float32(limit), q.numpy(), row_stats.numpy(), outlier.numpy(), bad.numpy(), pieces)
    if bool(bad.any()):
        return reference()
    return q, row_stats, torch.argwhere(outlier).view(-1)


def mm_dequant_cpu(rows: torch.Tensor, row_stats, col_stats, scale: float, dtype, bias, reference):
    """``reference()``'s result for a non-empty int32 (rows, N) ``rows``, computed in float32
    as it does; a float64 bias (which promotes the sum to float64), or no numba: ``reference()``."""
    numba = usable_numba("int8_mm_dequant", "running the reference kernel")
    if numba is None or (bias is not None and bias.dtype == torch.float64):
        return reference()
    out = torch.empty(rows.shape, dtype=dtype)
    bias_bits = np.empty(0, np.uint32) if bias is None else _as_bits(bias.contiguous())
    kernel, pieces = _kernel("dequant", *rows.shape, numba)
    with kernel_lock:
        kernel(
            rows.contiguous().numpy(),
            row_stats.contiguous().view(-1).numpy(),
            col_stats.contiguous().view(-1).numpy(),
            np.float32(scale),
            bias_bits,
            out.numpy() if dtype == torch.float32 else _as_bits(out),
            pieces,
        )
    return out
