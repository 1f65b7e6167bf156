"""Fast CPU kernels for blockwise 8-bit and 4-bit quantization (numba, compiled at first use).

They follow the reference kernels in ``ops/blockwise.py`` operation for operation in
float32 (reciprocal-multiply for full blocks, division for the partial last block, the
same clamps), so codes and absmax are bit-identical. The nearest code is found
exactly: a table indexed by the top 16 bits of the scaled float32 gives a lower bound
on the answer, and one comparison (a short scan for unusual codes) finishes it, which
is bucketize's answer.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
import torch

from tightfit._hugepages import empty_with_huge_pages
from tightfit.ops._numba import kernel_lock, load_numba, usable_numba

__all__: list[str] = []

_IDENTITY = np.arange(256, dtype=np.uint8)  # 8-bit codes need no reordering
#: Work items per parallel launch: each allocates its scratch once and runs many blocks.
CHUNKS = 256


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The decision boundaries between neighbouring entries of a sorted code (float32)."""
    return (code[:-1] + code[1:]) / 2


@functools.lru_cache(maxsize=16)
def _search_table(bounds_bytes: bytes) -> tuple[np.ndarray, np.ndarray, bool]:
    """(bounds + inf, table, single_step) for finding codes from a float32's top 16 bits.

    table[t] counts the bounds below the smallest float whose top 16 bits are t, a lower
    bound on bucketize's answer for every value in that bucket. When no bucket holds
    more than one bound (true for the dynamic map, NF4 and FP4), one comparison
    finishes the search; otherwise a short scan does.
    """
    bounds = np.frombuffer(bounds_bytes, dtype=np.float32)
    top = np.arange(1 << 16, dtype=np.uint32)
    negative = (top & 0x8000) != 0
    smallest = ((top << 16) | np.where(negative, 0xFFFF, 0).astype(np.uint32)).view(np.float32)
    largest = ((top << 16) | np.where(negative, 0, 0xFFFF).astype(np.uint32)).view(np.float32)
    finite = np.isfinite(smallest) & np.isfinite(largest)
    below_smallest = np.where(finite, np.searchsorted(bounds, smallest, side="left"), 0)
    below_largest = np.where(finite, np.searchsorted(bounds, largest, side="left"), 0)
    single_step = bool((below_largest - below_smallest).max() <= 1)
    padded = np.append(bounds, np.float32(np.inf)).astype(np.float32)
    return padded, below_smallest.astype(np.uint8 if bounds.size < 256 else np.uint16), single_step


@functools.lru_cache(maxsize=1)
def _kernels():
    numba, _ = load_numba()

    @numba.njit(inline="always")
    def scale_block(x32, x16, from_bf16, start, end, full, scratch):
        """Load a block into float32 scratch, scale it into [-1, 1] as the reference does;
        returns the absmax to store (NaN if the block holds one)."""
        count = end - start
        if from_bf16:
            bits = scratch.view(np.uint32)
            for i in range(count):
                bits[i] = np.uint32(x16[start + i]) << np.uint32(16)
        else:
            for i in range(count):
                scratch[i] = x32[start + i]
        amax = np.float32(0.0)
        has_nan = False
        for i in range(count):
            magnitude = abs(scratch[i])
            has_nan |= magnitude != magnitude
            amax = magnitude if magnitude > amax else amax
        if has_nan:
            return np.float32(np.nan)
        clamped = max(amax, np.float32(1e-38))
        if full:  # full blocks multiply by the reciprocal, the partial block divides
            inverse = np.float32(1.0) / clamped
            for i in range(count):
                scratch[i] = min(max(scratch[i] * inverse, np.float32(-1.0)), np.float32(1.0))
            return amax
        for i in range(count):
            scratch[i] = min(max(scratch[i] / clamped, np.float32(-1.0)), np.float32(1.0))
        return clamped

    @numba.njit(inline="always")
    def code_of(value, bits, bounds, table, single_step):
        index = np.int64(table[bits >> np.uint32(16)])
        if single_step:
            return index + np.int64(value > bounds[index])
        while value > bounds[index]:
            index += 1
        return index

    @numba.njit(inline="always")
    def code_block(scratch, count, bounds, table, single_step, codes):
        bits = scratch.view(np.uint32)
        for i in range(count):
            codes[i] = code_of(scratch[i], bits[i], bounds, table, single_step)

    @numba.njit(parallel=True, nogil=True, cache=True)
    def quantize(x32, x16, from_bf16, n, blocksize, bounds, table, single_step, order, four_bit, out, absmax):
        """Scale and code every block; 8-bit writes one code per value, 4-bit maps codes
        through ``order`` and packs two per byte (an odd tail padded with a zero's code)."""
        zero = np.zeros(1, np.float32)
        pad = order[code_of(zero[0], zero.view(np.uint32)[0], bounds, table, single_step)]
        blocks = absmax.shape[0]
        for chunk in numba.prange(CHUNKS):
            scratch = np.empty(blocksize, np.float32)
            codes = np.empty(blocksize + 1, np.uint8)
            for block in range(chunk * blocks // CHUNKS, (chunk + 1) * blocks // CHUNKS):
                start = block * blocksize
                end = min(start + blocksize, n)
                count = end - start
                stored = scale_block(x32, x16, from_bf16, start, end, count == blocksize, scratch)
                absmax[block] = stored
                if stored != stored:
                    continue  # NaN: the caller reports it; codes are left unwritten
                code_block(scratch, count, bounds, table, single_step, codes)
                if not four_bit:
                    for i in range(count):
                        out[start + i] = codes[i]
                    continue
                codes[count] = pad
                for i in range(0, count, 2):
                    low = order[codes[i + 1]] if i + 1 < count else pad
                    out[(start + i) // 2] = (np.int64(order[codes[i]]) << 4) | np.int64(low)

    @numba.njit(inline="always")
    def scaled_code(code, scale, values, rounded, as_bf16):
        """code * scale in float32 (as the reference), as float32 bits or bf16 bits (torch's rounding)."""
        for j in range(code.shape[0]):
            values[j] = code[j] * scale
        bits = values.view(np.uint32)
        if not as_bf16:
            return bits
        for j in range(code.shape[0]):
            b = bits[j]
            if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                rounded[j] = np.uint32(0x7FC0)  # torch's NaN
            else:
                rounded[j] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return rounded

    @numba.njit(parallel=True, nogil=True, cache=True)
    def dequantize(data, absmax, code, blocksize, n, out, as_bf16, four_bit):
        """out[i] = code[c_i] * absmax[block], through one scaled table per block; codes are
        bytes (8-bit) or nibbles, high first (4-bit)."""
        blocks = absmax.shape[0]
        for chunk in numba.prange(CHUNKS):
            values = np.empty(code.shape[0], np.float32)
            rounded = np.empty(code.shape[0], np.uint32)
            for block in range(chunk * blocks // CHUNKS, (chunk + 1) * blocks // CHUNKS):
                table = scaled_code(code, absmax[block], values, rounded, as_bf16)
                start = block * blocksize
                end = min(start + blocksize, n)
                if not four_bit:
                    for i in range(start, end):
                        out[i] = table[data[i]]
                    continue
                for i in range(start, end - 1, 2):
                    byte = np.int64(data[i // 2])
                    out[i] = table[byte >> 4]
                    out[i + 1] = table[byte & 15]
                if (end - start) % 2:
                    out[end - 1] = table[np.int64(data[(end - 1) // 2]) >> 4]

    @numba.njit(parallel=True, nogil=True, cache=True)
    def gemv_4bit(x, packed, absmax, code, blocksize, rows, cols, out):
        """out[m, j] = sum_k x[m, k] * W[j, k], decoding W one block at a time (never whole)."""
        for j in numba.prange(rows):
            table = np.empty(16, np.float32)
            for m in range(x.shape[0]):
                acc = np.float32(0.0)
                i = j * cols
                end = i + cols
                while i < end:
                    block = i // blocksize
                    stop = min(end, (block + 1) * blocksize)
                    scale = absmax[block]
                    for c in range(16):
                        table[c] = code[c] * scale
                    k = i - j * cols
                    if (i & 1) == 0 and ((stop - i) & 1) == 0:  # whole bytes: two values per byte, no parity test
                        for byte_index in range(i >> 1, stop >> 1):
                            byte = np.int64(packed[byte_index])
                            acc += x[m, k] * table[byte >> 4] + x[m, k + 1] * table[byte & 15]
                            k += 2
                        i = stop
                    while i < stop:
                        byte = np.int64(packed[i >> 1])
                        acc += x[m, k] * table[(byte >> 4) if (i & 1) == 0 else (byte & 15)]
                        i += 1
                        k += 1
                out[m, j] = acc

    return SimpleNamespace(quantize=quantize, dequantize=dequantize, gemv_4bit=gemv_4bit)


def block_count(numel: int, blocksize: int) -> int:
    """Blocks of ``blocksize`` covering ``numel`` values (the last may be partial)."""
    return -(-numel // blocksize)


def _search(code_sorted: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool]:
    return _search_table(midpoints(code_sorted).contiguous().numpy().tobytes())


def _source(A: torch.Tensor) -> tuple[np.ndarray, np.ndarray, bool]:
    """(float32 values, bf16 bits, from_bf16): bf16 is widened inside the kernel, block by block."""
    if A.dtype == torch.bfloat16:
        bits = A.reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16)
        return np.empty(0, np.float32), bits, True
    return A.reshape(-1).float().contiguous().numpy(), np.empty(0, np.uint16), False


def quantize_cpu(op: str, A: torch.Tensor, blocksize: int, sorted_code: torch.Tensor, order: torch.Tensor | None, reference):
    """8-bit codes shaped like ``A`` (``order`` None) or packed 4-bit codes mapped through ``order``; and absmax."""
    if usable_numba(op, "running the reference kernel") is None:
        return reference()
    four_bit = order is not None
    out = torch.empty((A.numel() + 1) // 2 if four_bit else A.shape, dtype=torch.uint8)
    absmax = torch.empty(block_count(A.numel(), blocksize), dtype=torch.float32)
    order = order.to(torch.uint8).numpy() if four_bit else _IDENTITY
    with kernel_lock:
        _kernels().quantize(*_source(A), A.numel(), blocksize, *_search(sorted_code), order, four_bit, out.view(-1).numpy(), absmax.numpy())
    return out, absmax


def _dequantize_into(op: str, data: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                     blocksize: int, numel: int, dtype: torch.dtype, reference) -> torch.Tensor:
    if usable_numba(op, "running the reference kernel") is None:
        return reference()
    as_bf16 = dtype == torch.bfloat16
    out = empty_with_huge_pages((numel,), torch.bfloat16 if as_bf16 else torch.float32)
    target = out.view(torch.int16).numpy().view(np.uint16) if as_bf16 else out.view(torch.int32).numpy().view(np.uint32)
    absmax32 = absmax.float().contiguous().numpy()
    code32 = code.float().contiguous().numpy()
    with kernel_lock:
        _kernels().dequantize(data.numpy(), absmax32, code32, blocksize, numel, target, as_bf16, op == "dequantize_4bit")
    return out if out.dtype == dtype else out.to(dtype)


def dequantize_8bit_cpu(A, absmax, code, blocksize, dtype, reference) -> torch.Tensor:
    out = _dequantize_into("dequantize_blockwise", A.reshape(-1).contiguous(), absmax, code, blocksize, A.numel(), dtype, reference)
    return out.reshape(A.shape)


def dequantize_4bit_cpu(A, absmax, code, blocksize, shape, dtype, reference) -> torch.Tensor:
    numel = math.prod(shape)
    out = _dequantize_into("dequantize_4bit", A.reshape(-1).view(torch.uint8).contiguous(), absmax, code, blocksize, numel, dtype, reference)
    return out.reshape(shape)


def gemv_4bit_cpu(A, B, shape, absmax, code, blocksize, reference) -> torch.Tensor:
    if usable_numba("gemv_4bit", "running the reference kernel") is None:
        return reference()
    rows, cols = shape
    x = A.reshape(-1, cols).float().contiguous()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    with kernel_lock:
        _kernels().gemv_4bit(x.numpy(), B.reshape(-1).view(torch.uint8).contiguous().numpy(), absmax.float().contiguous().numpy(),
                      code.float().contiguous().numpy(), blocksize, rows, cols, out.numpy())
    return out.to(A.dtype).reshape(*A.shape[:-1], rows)
