"""Fast CPU kernels for blockwise 8-bit and 4-bit quantization (numba, compiled at first use).

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
from types import SimpleNamespace

import numpy as np
import torch

from tightfit.ops._arg_checks import block_count
from tightfit.ops._hugepages import empty_with_huge_pages
from tightfit.ops._numba import kernel_lock, load_numba, usable_numba

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


@functools.lru_cache(maxsize=1)
def _kernels():
    numba, _ = load_numba()

    @numba.njit(inline="always")
    def code_of(value, table):
        """bucketize's answer for ``value``, mapped through the code order (see _search_table)."""
        bits = np.float32(value).view(np.uint32)
        key = np.uint32(bits ^ np.uint32(np.uint32(np.int32(bits) >> 31) | np.uint32(0x80000000)))
        entry = table[key >> 16]
        above = np.uint32(key & 0xFFFF) > np.uint32(entry & 0xFFFF)
        return np.uint32(entry >> 24) if above else np.uint32((entry >> 16) & 0xFF)

    @numba.njit(inline="always")
    def scaled(bits, i, widen, factor, full):
        """Value i (float32 bits, or bf16 bits with ``widen`` 65536) scaled into [-1, 1] as the
        reference scales it: times the reciprocal in full blocks, divided in the partial one."""
        value = np.uint32(np.uint32(bits[i]) * widen).view(np.float32)
        scaled = value * factor if full else value / factor
        if scaled != scaled:  # NaN of either sign sorts above every bound, as in torch.bucketize
            return np.float32(np.nan)
        return min(max(scaled, np.float32(-1.0)), np.float32(1.0))

    @numba.njit(parallel=True, nogil=True, cache=True)
    def quantize(bits, n, blocksize, table, bounds, single_step, four_bit, out, absmax):
        """Scale and code every block of float32 or bf16 ``bits`` (widened value by value, no
        float copy); 8-bit writes one code per value, 4-bit packs two per byte, an odd tail
        padded with a scaled zero's code."""
        widen = np.uint32(1 << (32 - 8 * bits.itemsize))  # a multiply, not a shift, so it stays 32-bit
        pad = code_of(np.float32(0.0), table)
        for block in numba.prange(absmax.shape[0]):  # each thread gets one contiguous run of blocks
            start = np.uint64(block * blocksize)
            end = np.uint64(min(block * blocksize + blocksize, n))
            peak = np.uint32(0)
            for i in range(start, end):  # an integer max over |x|'s bits: vectorizes, and NaN is the largest
                peak = max(peak, np.uint32(np.uint32(bits[i]) * widen) & np.uint32(0x7FFFFFFF))
            full = end - start == blocksize
            if peak > np.uint32(0x7F800000):  # NaN: every value scales to NaN, as in the reference
                absmax[block] = np.float32(np.nan)
                factor = np.float32(np.nan)
            else:
                amax = np.uint32(peak).view(np.float32)
                clamped = max(amax, np.float32(1e-38))
                absmax[block] = amax if full else clamped
                factor = np.float32(1.0) / clamped if full else clamped
            if not four_bit:
                for i in range(start, end):
                    out[i] = code_of(scaled(bits, i, widen, factor, full), table)
                if not single_step:  # buckets with several bounds gave the lowest code: scan on from it
                    for i in range(start, end):
                        value = scaled(bits, i, widen, factor, full)
                        index = np.int64(out[i])
                        while value > bounds[index]:
                            index += 1
                        out[i] = index
                continue
            for k in range(start >> np.uint64(1), end >> np.uint64(1)):
                i = k << np.uint64(1)
                high = code_of(scaled(bits, i, widen, factor, full), table)
                low = code_of(scaled(bits, i + np.uint64(1), widen, factor, full), table)
                out[k] = (high << np.uint32(4)) | low
            if (end - start) & np.uint64(1):
                last = code_of(scaled(bits, end - np.uint64(1), widen, factor, full), table)
                out[end >> np.uint64(1)] = (last << np.uint32(4)) | pad

    @numba.njit(inline="always")
    def encode(value, width):
        """float32 ``value`` as float32 bits (``width`` 4) or as bf16 bits rounded as torch rounds."""
        bits = np.float32(value).view(np.uint32)
        if width == 4:
            return bits
        rounded = np.uint32(np.uint32(bits + np.uint32(0x7FFF) + np.uint32((bits >> 16) & 1)) >> 16)
        return np.uint32(0x7FC0) if np.uint32(bits & 0x7FFFFFFF) > np.uint32(0x7F800000) else rounded  # torch's NaN

    @numba.njit(parallel=True, nogil=True, cache=True)
    def dequantize(data, absmax, code, pairs, blocksize, n, out):
        """out[i] = code[c_i] * absmax[block] in float32, stored as float32 or bf16 bits (out's
        width); codes are bytes (8-bit, ``pairs`` empty) or nibbles, high first, decoded a
        byte at a time through ``pairs`` (4-bit)."""
        width = out.itemsize
        four_bit = pairs.shape[0] != 0
        for block in numba.prange(absmax.shape[0]):  # each thread gets one contiguous run of blocks
            scale = absmax[block]
            start = np.uint64(block * blocksize)
            end = np.uint64(min(block * blocksize + blocksize, n))
            if not four_bit:
                for i in range(start, end):
                    out[i] = encode(code[data[i]] * scale, width)
                continue
            for k in range(start >> np.uint64(1), end >> np.uint64(1)):
                pair = pairs[data[k]]
                first = np.uint32(pair & np.uint64(0xFFFFFFFF)).view(np.float32)
                second = np.uint32(pair >> np.uint64(32)).view(np.float32)
                out[k << np.uint64(1)] = encode(first * scale, width)
                out[(k << np.uint64(1)) | np.uint64(1)] = encode(second * scale, width)
            if (end - start) & np.uint64(1):
                out[end - np.uint64(1)] = encode(code[data[end >> np.uint64(1)] >> np.uint8(4)] * scale, width)

    @numba.njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc"})
    def gemv_4bit(x, packed, absmax, code, pairs, blocksize, cols, out):
        """out[m, j] = sum_k x[m, k] * W[j, k] for flat ``x``, decoding W a block at a time
        (never whole): each block's dot product with the unscaled codes, a byte at a time
        through ``pairs``, is scaled once. Sums are reassociated so they vectorize; results
        agree with the reference to rounding."""
        for j in numba.prange(out.shape[1]):
            row = np.uint64(j * cols)
            end = row + np.uint64(cols)
            for m in range(out.shape[0]):
                xm = np.uint64(m * cols)
                acc = np.float32(0.0)
                i = row
                while i < end:
                    block = i // np.uint64(blocksize)
                    stop = min(end, (block + np.uint64(1)) * np.uint64(blocksize))
                    part = np.float32(0.0)
                    if ((i | stop) & np.uint64(1)) == 0:  # whole bytes
                        for byte in range(i >> np.uint64(1), stop >> np.uint64(1)):
                            pair = pairs[packed[byte]]
                            k = xm + ((byte << np.uint64(1)) - row)
                            part += x[k] * np.uint32(pair & np.uint64(0xFFFFFFFF)).view(np.float32)
                            part += x[k + np.uint64(1)] * np.uint32(pair >> np.uint64(32)).view(np.float32)
                    else:
                        for t in range(i, stop):
                            nibbles = packed[t >> np.uint64(1)]
                            part += (
                                x[xm + (t - row)]
                                * code[(nibbles & np.uint8(15)) if t & np.uint64(1) else (nibbles >> np.uint8(4))]
                            )
                    acc += part * absmax[block]
                    i = stop
                out[m, j] = acc

    return SimpleNamespace(quantize=quantize, dequantize=dequantize, gemv_4bit=gemv_4bit)


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
    if usable_numba(op, "running the reference kernel") is None:
        return reference()
    as_bf16 = dtype == torch.bfloat16
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
