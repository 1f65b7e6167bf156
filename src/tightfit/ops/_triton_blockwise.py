"""Triton kernels for blockwise 8-bit and 4-bit quantization on GPUs (imported at first use).

They do what the reference kernels in ``ops/blockwise.py`` do, operation for operation in
float32, so codes and absmax are bit-identical: the reciprocal is taken with an
IEEE-rounded division (Triton's plain ``/`` is approximate on NVIDIA GPUs), full blocks
multiply by it, the partial last block divides, and the nearest code is bucketize's
answer over the midpoints of the sorted code (ties to the lower entry). It is found with
the CPU kernel's table: one load, indexed by the top 16 bits of the value's
order-preserving key, and one comparison (for the dynamic map, NF4 and FP4); crowded
custom 8-bit codes take a branch-free binary search. One program quantizes several
whole blocks, so a block's absmax never leaves registers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from tightfit.ops._cpu_blockwise import search_table as cpu_search_table

__all__: list[str] = []

#: Elements one quantize program covers (several small blocks, or one large one).
_QUANTIZE_TILE = 1024
#: Elements one dequantize program writes, and its warps.
_DEQUANTIZE_TILE = 4096
_DEQUANTIZE_WARPS = 4
#: Weight rows and packed bytes per row one gemv program decodes per step, and its warps.
_GEMV_ROWS = 1
_GEMV_BYTES = 256
_GEMV_WARPS = 1
#: Warps per quantize program.
_QUANTIZE_WARPS = 2
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
        probe = tl.load(bounds_ptr + position + ((1 << (STEPS - 1 - level)) - 1))
        position = tl.where(probe < value, position + (1 << (STEPS - 1 - level)), position)
    return position


@triton.jit
def _nearest(value, bounds_ptr, table_ptr, STEPS: tl.constexpr, SINGLE_STEP: tl.constexpr):
    """The code of ``value``: from the CPU kernel's table (one load and one comparison,
    the code order included), or, for crowded codes, a binary search (sorted position)."""
    if SINGLE_STEP:
        # The float's bits as an order-preserving unsigned key, held in int64.
        bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        key = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
        entry = tl.load(table_ptr + (key >> 16)).to(tl.int64) & 0xFFFFFFFF
        return tl.where((key & 0xFFFF) > (entry & 0xFFFF), (entry >> 24) & 0xFF, (entry >> 16) & 0xFF)
    else:
        return _count_below(value, bounds_ptr, STEPS)


@triton.jit
def _block_absmax(x):
    """max |x| per row, NaN when the row holds one (so the caller can refuse it)."""
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    return tl.where(has_nan, float("nan"), tl.max(tl.abs(x), axis=1)).to(tl.float32)


@triton.jit
def _quantized_blocks(
    x_ptr,
    bounds_ptr,
    table_ptr,
    absmax_ptr,
    numel,
    n_blocks,
    BLOCKSIZE: tl.constexpr,
    GROUP: tl.constexpr,
    MINIMUM: tl.constexpr,
    STEPS: tl.constexpr,
    SINGLE_STEP: tl.constexpr,
):
    """Sorted-code indices of this program's GROUP whole blocks, shaped (GROUP, BLOCKSIZE);
    stores their absmax. Elements past the end read as 0.0 (a scaled zero)."""
    blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    offsets = blocks[:, None].to(tl.int64) * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    tail = (blocks.to(tl.int64) + 1) * BLOCKSIZE > numel
    absmax = _block_absmax(x)
    # The reference clamps the partial last block's absmax before it is stored.
    stored = tl.where(tail, tl.maximum(absmax, MINIMUM), absmax).to(tl.float32)
    tl.store(absmax_ptr + blocks, stored, mask=blocks < n_blocks)
    return _nearest(_scaled(x, absmax, tail, MINIMUM), bounds_ptr, table_ptr, STEPS, SINGLE_STEP), offsets


@triton.jit
def _quantize_8bit_kernel(
    x_ptr,
    bounds_ptr,
    table_ptr,
    q_ptr,
    absmax_ptr,
    numel,
    n_blocks,
    BLOCKSIZE: tl.constexpr,
    GROUP: tl.constexpr,
    MINIMUM: tl.constexpr,
    SINGLE_STEP: tl.constexpr,
):
    codes, offsets = _quantized_blocks(
        x_ptr, bounds_ptr, table_ptr, absmax_ptr, numel, n_blocks, BLOCKSIZE, GROUP, MINIMUM, 8, SINGLE_STEP
    )
    tl.store(q_ptr + offsets, codes.to(tl.uint8), mask=offsets < numel)


@triton.jit
def _quantize_4bit_kernel(
    x_ptr,
    bounds_ptr,
    table_ptr,
    packed_ptr,
    absmax_ptr,
    numel,
    n_blocks,
    BLOCKSIZE: tl.constexpr,
    GROUP: tl.constexpr,
    MINIMUM: tl.constexpr,
):
    # 4-bit codes always take the table path, whose entries are already in code order.
    codes, _ = _quantized_blocks(
        x_ptr, bounds_ptr, table_ptr, absmax_ptr, numel, n_blocks, BLOCKSIZE, GROUP, MINIMUM, 4, True
    )
    high, low = tl.split(tl.reshape(codes, (GROUP, BLOCKSIZE // 2, 2)))
    first = (tl.program_id(0) * GROUP + tl.arange(0, GROUP))[:, None].to(tl.int64) * BLOCKSIZE + 2 * tl.arange(
        0, BLOCKSIZE // 2
    )[None, :]
    # An odd count's last byte pairs the last value with the scaled zero read past the end.
    tl.store(packed_ptr + first // 2, ((high << 4) | low).to(tl.uint8), mask=first < numel)


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
def _dequantize_kernel(
    data_ptr, absmax_ptr, code_ptr, out_ptr, numel, BLOCKSIZE: tl.constexpr, FOUR_BIT: tl.constexpr, TILE: tl.constexpr
):
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = offsets < numel
    values = _decoded(data_ptr, absmax_ptr, code_ptr, offsets, inside, BLOCKSIZE, FOUR_BIT)
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _gemv_kernel(
    x_ptr,
    data_ptr,
    absmax_ptr,
    code_ptr,
    out_ptr,
    rows,
    cols: tl.constexpr,
    row_bytes: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    FOUR_BIT: tl.constexpr,
):
    # 4-bit: each byte holds two neighbouring weights of one row (``cols`` is even,
    # ``row_bytes`` its half); 8-bit: one. ``cols`` is a compile-time constant: a model has
    # a handful of input widths, and a known trip count lets Triton pipeline the loop.
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token = tl.program_id(1).to(tl.int64)
    total = tl.zeros((BLOCK_ROWS, BLOCK_BYTES), tl.float32)
    for start in tl.range(0, row_bytes, BLOCK_BYTES):
        column = start + tl.arange(0, BLOCK_BYTES)
        byte_index = row[:, None].to(tl.int64) * row_bytes + column[None, :]
        inside = (row[:, None] < rows) & (column[None, :] < row_bytes)
        byte = tl.load(data_ptr + byte_index, mask=inside, other=0).to(tl.int32)
        # Each weight is rounded to the activation's dtype first, as the reference's dequantize does.
        if FOUR_BIT:
            scale = tl.load(absmax_ptr + (2 * byte_index) // BLOCKSIZE, mask=inside, other=0.0)
            high = (tl.load(code_ptr + (byte >> 4)) * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
            low = (tl.load(code_ptr + (byte & 15)) * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
            first = tl.load(x_ptr + token * cols + 2 * column, mask=column < row_bytes, other=0.0).to(tl.float32)
            second = tl.load(x_ptr + token * cols + 2 * column + 1, mask=column < row_bytes, other=0.0).to(tl.float32)
            total += high * first[None, :] + low * second[None, :]
        else:
            scale = tl.load(absmax_ptr + byte_index // BLOCKSIZE, mask=inside, other=0.0)
            weight = (tl.load(code_ptr + byte) * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = tl.load(x_ptr + token * cols + column, mask=column < row_bytes, other=0.0).to(tl.float32)
            total += weight * x[None, :]
    tl.store(out_ptr + token * rows + row, tl.sum(total, axis=1).to(out_ptr.dtype.element_ty), mask=row < rows)


def search_tables(
    sorted_code: torch.Tensor, device: torch.device, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(bounds padded with +inf, the CPU kernel's search table, single_step) for a sorted
    code, on ``device``; ``order`` maps sorted positions to codes (identity if None)."""
    bounds, table, single_step = cpu_search_table(sorted_code.float().cpu(), None if order is None else order.cpu())
    return torch.from_numpy(bounds).to(device), torch.from_numpy(table.view(np.int32)).to(device), single_step


def _group(blocksize: int) -> int:
    return max(_QUANTIZE_TILE // blocksize, 1)


def quantize(
    A: torch.Tensor, blocksize: int, search: tuple[torch.Tensor, torch.Tensor, bool], four_bit: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax): 8-bit codes shaped like A, or 4-bit codes packed two per byte;
    ``search`` comes from :func:`search_tables`."""
    flat = A.contiguous().view(-1)
    numel = flat.numel()
    n_blocks = -(-numel // blocksize)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=A.device)
    group = _group(blocksize)
    grid = (triton.cdiv(n_blocks, group),)
    bounds, table, single_step = search
    options = dict(BLOCKSIZE=blocksize, GROUP=group, MINIMUM=_MINIMUM_ABSMAX, num_warps=_QUANTIZE_WARPS)
    if not four_bit:
        q = torch.empty(A.shape, dtype=torch.uint8, device=A.device)
        if numel:
            _quantize_8bit_kernel[grid](
                flat, bounds, table, q, absmax, numel, n_blocks, SINGLE_STEP=single_step, **options
            )
        return q, absmax
    if not single_step:
        raise ValueError("internal: 4-bit codes must be searchable in one step")  # true of NF4 and FP4
    packed = torch.empty((numel + 1) // 2, dtype=torch.uint8, device=A.device)
    if numel:
        _quantize_4bit_kernel[grid](flat, bounds, table, packed, absmax, numel, n_blocks, **options)
    return packed, absmax


def dequantize(
    data: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    blocksize: int,
    shape: list[int],
    dtype: torch.dtype,
    four_bit: bool,
) -> torch.Tensor:
    """``code[q] * absmax[block]`` as a ``dtype`` tensor of ``shape``."""
    out = torch.empty(shape, dtype=dtype, device=data.device)
    numel = out.numel()
    if numel:
        grid = (triton.cdiv(numel, _DEQUANTIZE_TILE),)
        _dequantize_kernel[grid](
            data.contiguous().view(torch.uint8).view(-1),
            absmax.float().contiguous(),
            code.float().contiguous(),
            out,
            numel,
            BLOCKSIZE=blocksize,
            FOUR_BIT=four_bit,
            TILE=_DEQUANTIZE_TILE,
            num_warps=_DEQUANTIZE_WARPS,
        )
    return out


def gemv(
    A: torch.Tensor,
    data: torch.Tensor,
    shape: Sequence[int],
    absmax: torch.Tensor,
    code: torch.Tensor,
    blocksize: int,
    four_bit: bool,
) -> torch.Tensor:
    """``A @ dequantize(data).T``, decoding the weight tile by tile (a few tokens): 4-bit
    codes packed two per byte (even ``cols``), or 8-bit codes one per byte. The layers'
    direct path calls this with their tensors as they are, past the op's dispatch."""
    rows, cols = shape
    x = A.contiguous().view(-1, cols)
    out = torch.empty(x.shape[0], rows, dtype=A.dtype, device=A.device)
    if out.numel():
        _gemv_kernel[(triton.cdiv(rows, _GEMV_ROWS), x.shape[0])](
            x,
            data.contiguous().view(torch.uint8).view(-1),
            absmax.float().contiguous(),
            code.float().contiguous(),
            out,
            rows,
            cols,
            cols // 2 if four_bit else cols,
            BLOCKSIZE=blocksize,
            BLOCK_ROWS=_GEMV_ROWS,
            BLOCK_BYTES=_GEMV_BYTES,
            FOUR_BIT=four_bit,
            num_warps=_GEMV_WARPS,
        )
    return out.view(*A.shape[:-1], rows)
