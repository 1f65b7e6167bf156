"""Triton kernels for blockwise 8-bit and 4-bit quantization on GPUs (imported at first use).

They do what the reference kernels in ``ops/blockwise.py`` do, operation for operation in
float32, so codes and absmax are bit-identical: the reciprocal is taken with an
IEEE-rounded division (Triton's plain ``/`` is approximate on NVIDIA GPUs), full blocks
multiply by it, the partial last block divides, and the nearest code is found by a
branch-free binary search over the midpoints of the sorted code (ties to the lower
entry, as bucketize resolves them). One program quantizes several whole blocks, so a
block's absmax never leaves registers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__: list[str] = []

#: Elements one quantize program covers (several small blocks, or one large one).
_QUANTIZE_TILE = 2048
#: Elements one dequantize program writes.
_DEQUANTIZE_TILE = 4096
#: The reference clamps absmax to this before dividing by it.
_MINIMUM_ABSMAX = 1e-38


@triton.jit
def _scaled(x, absmax, tail, minimum: tl.constexpr):
    """x scaled into [-1, 1] by its block's absmax, exactly as the reference scales it."""
    safe = tl.maximum(absmax, minimum).to(tl.float32)[:, None]
    inverse = tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
    scaled = tl.where(tail[:, None], tl.math.div_rn(x, safe), x * inverse)
    return tl.minimum(tl.maximum(scaled, -1.0), 1.0)


@triton.jit
def _count_below(value, bounds_ptr, STEPS: tl.constexpr):
    """How many of the 2**STEPS - 1 sorted bounds lie strictly below ``value`` (bucketize)."""
    position = tl.zeros(value.shape, tl.int32)
    for level in tl.static_range(STEPS):
        step: tl.constexpr = 1 << (STEPS - 1 - level)
        probe = tl.load(bounds_ptr + position + (step - 1))
        position = tl.where(probe < value, position + step, position)
    return position


@triton.jit
def _block_absmax(x):
    """max |x| per row, NaN when the row holds one (so the caller can refuse it)."""
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    return tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=1)).to(tl.float32)


@triton.jit
def _store_absmax(absmax_ptr, absmax, blocks, n_blocks, tail, minimum: tl.constexpr):
    # The reference clamps the partial last block's absmax before it is stored.
    stored = tl.where(tail, tl.maximum(absmax, minimum), absmax)
    tl.store(absmax_ptr + blocks, stored.to(tl.float32), mask=blocks < n_blocks)


@triton.jit
def _quantize_8bit_kernel(x_ptr, bounds_ptr, q_ptr, absmax_ptr, numel, n_blocks,
                          BLOCKSIZE: tl.constexpr, GROUP: tl.constexpr, MINIMUM: tl.constexpr):
    blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    offsets = blocks[:, None].to(tl.int64) * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    inside = offsets < numel
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tail = (blocks.to(tl.int64) + 1) * BLOCKSIZE > numel
    absmax = _block_absmax(x)
    codes = _count_below(_scaled(x, absmax, tail, MINIMUM), bounds_ptr, 8)
    tl.store(q_ptr + offsets, codes.to(tl.uint8), mask=inside)
    _store_absmax(absmax_ptr, absmax, blocks, n_blocks, tail, MINIMUM)


@triton.jit
def _quantize_4bit_kernel(x_ptr, bounds_ptr, order_ptr, packed_ptr, absmax_ptr, numel, n_blocks,
                          BLOCKSIZE: tl.constexpr, GROUP: tl.constexpr, MINIMUM: tl.constexpr):
    blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    first = blocks[:, None].to(tl.int64) * BLOCKSIZE + 2 * tl.arange(0, BLOCKSIZE // 2)[None, :]
    # An odd count pads the last byte with a scaled zero: the masked load's 0.0.
    high = tl.load(x_ptr + first, mask=first < numel, other=0.0).to(tl.float32)
    low = tl.load(x_ptr + first + 1, mask=first + 1 < numel, other=0.0).to(tl.float32)
    tail = (blocks.to(tl.int64) + 1) * BLOCKSIZE > numel
    high_max = _block_absmax(high)
    low_max = _block_absmax(low)
    absmax = tl.where((high_max != high_max) | (low_max != low_max), float("nan"), tl.maximum(high_max, low_max)).to(tl.float32)
    high_code = tl.load(order_ptr + _count_below(_scaled(high, absmax, tail, MINIMUM), bounds_ptr, 4))
    low_code = tl.load(order_ptr + _count_below(_scaled(low, absmax, tail, MINIMUM), bounds_ptr, 4))
    tl.store(packed_ptr + first // 2, ((high_code << 4) | low_code).to(tl.uint8), mask=first < numel)
    _store_absmax(absmax_ptr, absmax, blocks, n_blocks, tail, MINIMUM)


@triton.jit
def _decoded(data_ptr, absmax_ptr, code_ptr, offsets, inside, BLOCKSIZE: tl.constexpr, FOUR_BIT: tl.constexpr):
    """code[q] * absmax[block] in float32 for the elements at ``offsets``."""
    if FOUR_BIT:
        byte = tl.load(data_ptr + (offsets >> 1), mask=inside, other=0).to(tl.int32)
        index = tl.where((offsets & 1) == 1, byte & 15, byte >> 4)
    else:
        index = tl.load(data_ptr + offsets, mask=inside, other=0).to(tl.int32)
    scale = tl.load(absmax_ptr + offsets // BLOCKSIZE, mask=inside, other=0.0)
    return tl.load(code_ptr + index) * scale


@triton.jit
def _dequantize_kernel(data_ptr, absmax_ptr, code_ptr, out_ptr, numel,
                       BLOCKSIZE: tl.constexpr, FOUR_BIT: tl.constexpr, TILE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = offsets < numel
    values = _decoded(data_ptr, absmax_ptr, code_ptr, offsets, inside, BLOCKSIZE, FOUR_BIT)
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _gemv_4bit_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, out_ptr, rows, cols: tl.constexpr,
                      BLOCKSIZE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # ``cols`` is a compile-time constant: a model has a handful of input widths, and a
    # known trip count lets Triton pipeline the loop.
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token = tl.program_id(1).to(tl.int64)
    total = tl.zeros((BLOCK_ROWS, BLOCK_COLS), tl.float32)
    for start in tl.range(0, cols, BLOCK_COLS):
        col = start + tl.arange(0, BLOCK_COLS)
        offsets = row[:, None].to(tl.int64) * cols + col[None, :]
        inside = (row[:, None] < rows) & (col[None, :] < cols)
        # Round the weight to the activation's dtype first, as the reference's dequantize does.
        weight = _decoded(packed_ptr, absmax_ptr, code_ptr, offsets, inside, BLOCKSIZE, True)
        weight = weight.to(x_ptr.dtype.element_ty).to(tl.float32)
        x = tl.load(x_ptr + token * cols + col, mask=col < cols, other=0.0).to(tl.float32)
        total += weight * x[None, :]
    tl.store(out_ptr + token * rows + row, tl.sum(total, axis=1).to(out_ptr.dtype.element_ty), mask=row < rows)


def _bounds(sorted_code: torch.Tensor) -> torch.Tensor:
    """Midpoints of a sorted code, padded with +inf to a power-of-two count for the search."""
    middle = (sorted_code[:-1] + sorted_code[1:]) / 2
    return torch.cat([middle, middle.new_full((1,), math.inf)])


def _group(blocksize: int) -> int:
    return max(_QUANTIZE_TILE // blocksize, 1)


def quantize(A: torch.Tensor, blocksize: int, sorted_code: torch.Tensor, order: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) for 8-bit (``order`` None: uint8 shaped like A) or 4-bit (packed bytes)."""
    flat = A.contiguous().view(-1)
    numel = flat.numel()
    n_blocks = -(-numel // blocksize)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=A.device)
    group = _group(blocksize)
    grid = (triton.cdiv(n_blocks, group),)
    bounds = _bounds(sorted_code.float())
    if order is None:
        q = torch.empty(A.shape, dtype=torch.uint8, device=A.device)
        if numel:
            _quantize_8bit_kernel[grid](flat, bounds, q, absmax, numel, n_blocks, BLOCKSIZE=blocksize, GROUP=group, MINIMUM=_MINIMUM_ABSMAX)
        return q, absmax
    packed = torch.empty((numel + 1) // 2, dtype=torch.uint8, device=A.device)
    if numel:
        _quantize_4bit_kernel[grid](flat, bounds, order.to(torch.int32), packed, absmax, numel, n_blocks,
                                    BLOCKSIZE=blocksize, GROUP=group, MINIMUM=_MINIMUM_ABSMAX)
    return packed, absmax


def dequantize(data: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
               shape: list[int], dtype: torch.dtype, four_bit: bool) -> torch.Tensor:
    """``code[q] * absmax[block]`` as a ``dtype`` tensor of ``shape``."""
    out = torch.empty(shape, dtype=dtype, device=data.device)
    numel = out.numel()
    if numel:
        grid = (triton.cdiv(numel, _DEQUANTIZE_TILE),)
        _dequantize_kernel[grid](data.contiguous().view(torch.uint8).view(-1), absmax.float().contiguous(), code.float().contiguous(),
                                 out, numel, BLOCKSIZE=blocksize, FOUR_BIT=four_bit, TILE=_DEQUANTIZE_TILE)
    return out


def gemv_4bit(A: torch.Tensor, packed: torch.Tensor, shape: list[int], absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``A @ dequantize(packed).T``, decoding the weight tile by tile (for a few tokens)."""
    rows, cols = shape
    x = A.contiguous().view(-1, cols)
    out = torch.empty(x.shape[0], rows, dtype=A.dtype, device=A.device)
    if out.numel():
        block_rows = 16
        grid = (triton.cdiv(rows, block_rows), x.shape[0])
        _gemv_4bit_kernel[grid](x, packed.contiguous().view(torch.uint8).view(-1), absmax.float().contiguous(), code.float().contiguous(),
                                out, rows, cols, BLOCKSIZE=blocksize, BLOCK_ROWS=block_rows, BLOCK_COLS=256)
    return out.view(*A.shape[:-1], rows)
