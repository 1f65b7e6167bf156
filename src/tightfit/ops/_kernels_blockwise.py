"""The numba kernels of ``_cpu_blockwise`` (imported there at first use: it imports numba).

They live at module level, not in a factory's closure, so that numba's on-disk cache
finds them again in the next process: its index key hashes a pickle of a closure's
cells, and a jitted helper in a cell pickles with a fresh uuid in every process, which
made every process compile again. The helpers they inline stay in this file, so editing
one invalidates the cache of the kernels that use it (numba checks the source file's
timestamp, not the helpers').
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["dequantize", "gemv_4bit", "quantize"]


@numba.njit(inline="always")
def code_of(value, table):
    """bucketize's answer for ``value``, mapped through the code order (see _cpu_blockwise._search_table)."""
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
