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

__all__ = ["dequantize", "gemv_4bit", "quantize"]  # and the optimizer fallbacks any_32bit and any_8bit


@numba.njit(inline="always")
def code_of(value, table):
    """bucketize's answer for ``value``, mapped through the code order (see _cpu_blockwise._search_table)."""
    bits = np.float32(value).view(np.uint32)
    key = np.uint32(bits ^ np.uint32(np.uint32(np.int32(bits) >> 31) | np.uint32(0x80000000)))
    entry = table[key >> 16]
    above = np.uint32(key & 0xFFFF) > np.uint32(entry & 0xFFFF)
    return np.uint32(entry >> 24) if above else np.uint32((entry >> 16) & 0xFF)


@numba.njit(inline="always")
def widened(bits, i, widen):
    """Value i of float32 bits, or of bf16 bits with ``widen`` 65536, as float32."""
    return np.uint32(np.uint32(bits[i]) * widen).view(np.float32)


@numba.njit(inline="always")
def scale_value(value, factor, full):
    """``value`` scaled into [-1, 1] as the reference scales it: times the reciprocal in
    full blocks, divided in the partial one."""
    scaled = value * factor if full else value / factor
    if scaled != scaled:  # NaN of either sign sorts above every bound, as in torch.bucketize
        return np.float32(np.nan)
    return min(max(scaled, np.float32(-1.0)), np.float32(1.0))


@numba.njit(inline="always")
def scaled(bits, i, widen, factor, full):
    """Value i of ``bits`` (see :func:`widened`) scaled into [-1, 1]."""
    return scale_value(widened(bits, i, widen), factor, full)


@numba.njit(inline="always")
def block_scale(peak, full):
    """(absmax stored, scaling factor) of a block whose largest |value| has float32 bits
    ``peak`` (NaN is the largest): the reference's absmax, clamped in a partial block."""
    if peak > np.uint32(0x7F800000):  # NaN: every value scales to NaN, as in the reference
        return np.float32(np.nan), np.float32(np.nan)
    amax = np.uint32(peak).view(np.float32)
    clamped = max(amax, np.float32(1e-38))
    return (amax, np.float32(1.0) / clamped) if full else (clamped, clamped)


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
        absmax[block], factor = block_scale(peak, full)
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


# -- optimizer updates (tightfit.ops.optimizer): constants h in _cpu_optimizer.CONSTANTS order --


@numba.njit(inline="always")
def optimizer_step(kind, g, p, s0, s1, s2, h):
    """One update of value (g, p) and its states in float32, op by op as the reference
    (``ops/optimizer._step``) rounds them: (new p, new states). ``kind`` indexes OPTIMIZERS."""
    if kind >= 2 and kind <= 4 and h[8] > 0:
        g = g + p * h[8]
    if (kind <= 1 or kind == 5) and h[8] > 0:
        p = p * h[9]
    if kind == 0:  # adam
        s0 = s0 * h[0] + g * h[3]
        s1 = s1 * h[1] + (g * g) * h[4]
        p = p + (s0 / (np.sqrt(s1) * h[12] + h[7])) * h[13]
    elif kind == 1:  # ademamix
        s0 = s0 * h[0] + g * h[3]
        s1 = s1 * h[2] + g * h[5]
        s2 = s2 * h[1] + (g * g) * h[4]
        p = p - ((s0 * h[11] + s1 * h[6]) / (np.sqrt(s2) * h[12] + h[7])) * h[10]
    elif kind == 2:  # momentum
        s0 = g if h[14] != 0 else s0 * h[0] + g
        p = p - s0 * h[10]
    elif kind == 3:  # rmsprop
        s0 = s0 * h[0] + (g * g) * h[3]
        p = p - (g / (np.sqrt(s0) + h[7])) * h[10]
    elif kind == 4:  # adagrad
        s0 = s0 + g * g
        p = p - (g / (np.sqrt(s0) + h[7])) * h[10]
    else:  # lion
        mixed = s0 * h[0] + g * h[3]
        direction = np.float32(mixed > 0) - np.float32(mixed < 0)  # branch-free: the loop vectorizes
        s0 = s0 * h[1] + g * h[4]
        p = p - direction * h[10]
    return p, s0, s1, s2


@numba.njit(inline="always")
def optimizer_32bit(kind, g, g_widen, p, p_widen, s0, s1, s2, count, n, h):
    """One step over float32 or bf16 parameter bits ``p`` (written back in their width)
    with float32 states (``count`` of s0, s1, s2 used), 4,096 values per task. Each task
    indexes slices from 0, which lets the loop vectorize (offsets that could be negative,
    for all numba knows, keep it scalar: five times slower)."""
    width = p.itemsize
    for chunk in numba.prange((n + 4095) // 4096):
        start = chunk * 4096
        end = min(n, start + 4096)
        gs, ps, a0 = g[start:end], p[start:end], s0[start:end]
        a1 = s1[start:end] if count > 1 else s1
        a2 = s2[start:end] if count > 2 else s2
        for j in range(end - start):
            b = a1[j] if count > 1 else np.float32(0.0)
            c = a2[j] if count > 2 else np.float32(0.0)
            new_p, a, b, c = optimizer_step(kind, widened(gs, j, g_widen), widened(ps, j, p_widen), a0[j], b, c, h)
            ps[j] = encode(new_p, width)
            a0[j] = a
            if count > 1:
                a1[j] = b
            if count > 2:
                a2[j] = c


@numba.njit(inline="always")
def decoded(codes, absmax, code, j):
    return code[codes[j]] * absmax


@numba.njit(inline="always")
def optimizer_8bit(
    kind, g, g_widen, p, p_widen, c0, c1, c2, a0, a1, a2, m0, m1, m2, t0, t1, t2, count, n, blocksize, h
):
    """One step with 8-bit blockwise states (codes c*, absmax a*, maps m*, and their
    search tables t*, whose buckets hold one bound each: a single lookup), a block at a
    time while it is in cache: the new states are computed once for their absmax (a loop
    that stores nothing, so it vectorizes, gathers and all), then again from the same old
    codes to update p and code them; nothing is written before both. Blocks index slices
    from 0 (see :func:`optimizer_32bit`)."""
    width = p.itemsize
    zero = np.float32(0.0)
    for block in numba.prange((n + blocksize - 1) // blocksize):
        start = block * blocksize
        size = min(n, start + blocksize) - start
        full = size == blocksize
        gs, ps, q0 = g[start : start + size], p[start : start + size], c0[start : start + size]
        q1 = c1[start : start + size] if count > 1 else c1
        q2 = c2[start : start + size] if count > 2 else c2
        scale0 = a0[block]
        scale1 = a1[block] if count > 1 else zero
        scale2 = a2[block] if count > 2 else zero
        peak0 = peak1 = peak2 = np.uint32(0)
        for j in range(size):
            _, a, b, c = optimizer_step(
                kind,
                widened(gs, j, g_widen),
                widened(ps, j, p_widen),
                decoded(q0, scale0, m0, j),
                decoded(q1, scale1, m1, j) if count > 1 else zero,
                decoded(q2, scale2, m2, j) if count > 2 else zero,
                h,
            )
            peak0 = max(peak0, np.float32(a).view(np.uint32) & np.uint32(0x7FFFFFFF))
            peak1 = max(peak1, np.float32(b).view(np.uint32) & np.uint32(0x7FFFFFFF))
            peak2 = max(peak2, np.float32(c).view(np.uint32) & np.uint32(0x7FFFFFFF))
        new0, factor0 = block_scale(peak0, full)
        new1, factor1 = block_scale(peak1, full)
        new2, factor2 = block_scale(peak2, full)
        for j in range(size):
            new_p, a, b, c = optimizer_step(
                kind,
                widened(gs, j, g_widen),
                widened(ps, j, p_widen),
                decoded(q0, scale0, m0, j),
                decoded(q1, scale1, m1, j) if count > 1 else zero,
                decoded(q2, scale2, m2, j) if count > 2 else zero,
                h,
            )
            ps[j] = encode(new_p, width)
            q0[j] = code_of(scale_value(a, factor0, full), t0)
            if count > 1:
                q1[j] = code_of(scale_value(b, factor1, full), t1)
            if count > 2:
                q2[j] = code_of(scale_value(c, factor2, full), t2)
        a0[block] = new0
        if count > 1:
            a1[block] = new1
        if count > 2:
            a2[block] = new2


@numba.njit(parallel=True, nogil=True, cache=True)
def any_32bit(kind, count, g, gw, p, pw, s0, s1, s2, n, h):
    """Every rule's 32-bit step in one kernel (``kind`` and ``count`` at run time): the
    fallback where the native kernel does not build, compiled once, not once per rule."""
    optimizer_32bit(kind, g, gw, p, pw, s0, s1, s2, count, n, h)


@numba.njit(parallel=True, nogil=True, cache=True)
def any_8bit(kind, count, g, gw, p, pw, c0, c1, c2, a0, a1, a2, m0, m1, m2, t0, t1, t2, n, bs, h):
    """Every rule's 8-bit step in one kernel (``kind`` and ``count`` at run time): the
    fallback where the native kernel does not build, compiled once, not once per rule."""
    optimizer_8bit(kind, g, gw, p, pw, c0, c1, c2, a0, a1, a2, m0, m1, m2, t0, t1, t2, count, n, bs, h)
