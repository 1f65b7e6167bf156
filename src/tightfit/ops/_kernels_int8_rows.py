"""The numba kernels of ``_cpu_int8_rows`` (imported there at first use: it imports numba).

They live at module level, not in a factory's closure, so that numba's on-disk cache
finds them again in the next process: its index key hashes a pickle of a closure's
cells, and a jitted helper in a cell pickles with a fresh uuid in every process, which
made every process compile again. The helpers (and the per-dtype overloads) stay in
this file, so editing one invalidates the cache of the kernels that use it (numba
checks the source file's timestamp, not the helpers').
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

__all__ = ["mm_dequant", "mm_dequant_parallel", "vectorwise_quant", "vectorwise_quant_parallel"]


# The two helpers below are typed per dtype by numba's overload (below); never called from Python.
def _widen(bits):
    """The float32 value of a float32's bits (uint32), a bfloat16's (uint16) or a float16's (int16)."""


def _store(out, r, c, value):
    """``out[r, c] = value`` rounded half to even to ``out``'s float32 (float32), bfloat16
    (uint16) or float16 (int16) bits, as torch rounds."""


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
    round(x * (127 * (1 / scale))) half to even, outliers coded 0 and their columns flagged
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
    # 127 times the reciprocal, each rounded to float32: how torch computes ``127.0 / row_stats``
    # (the reference); the correctly rounded quotient differs by an ulp for some scales (120)
    scale = (np.float32(1.0) / stat) * np.float32(127.0) if largest > 0 else np.float32(0.0)
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
                _store(out, r, c, np.float32(product[r, c]) * (row_stats[r] * col_stats[c]) * scale + _widen(bias[c]))


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
