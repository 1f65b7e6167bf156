"""Products with a blockwise-quantized weight, a tile of weight rows at a time (private:
the many-token forward of ``Linear4bit`` / ``Linear8bit`` and of ``matmul_4bit``, and the
backward QLoRA runs through them).

The rows ``r0:r1`` of the weight are decoded by the ops (``ops.dequantize_4bit`` /
``ops.dequantize_blockwise``, with their checks) from slices of the codes and of the
block scales, straight into the input's dtype, and handed to the BLAS, which writes the
tile's output columns in place (``torch.addmm`` / ``torch.mm`` with ``out=`` a column
slice of the output). Each tile is dropped before the next is decoded, so a forward
holds one tile above its output, never the decoded weight (D10); the backward
accumulates ``grad[:, r0:r1] @ W[r0:r1]`` into the input's gradient the same way.

Blocks are contiguous runs of the flattened (out, in) weight, so a tile starting at row
``r0`` starts on a block when ``r0 * in`` is a multiple of the blocksize: tiles hold a
multiple of ``blocksize // gcd(in, blocksize)`` rows. 4-bit blocksizes are at least 32,
so a tile also starts on a byte of the packed codes. The last tile may be shorter and
end in the weight's partial last block. A weight of at most one tile is one tile: decoded
whole, as before tiling. Under torch.compile, which refuses ``out=`` a slice, each tile's
product is ``F.linear`` and the products are concatenated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tightfit import ops
from tightfit.ops._arg_checks import block_count, packed_bytes
from tightfit.quant.state import QuantState

__all__: list[str] = []

#: Bytes of one decoded tile (in the input's dtype). Chosen by measurement on a 2-core
#: AVX-512 CPU (MKL; numba decode; 128- and 512-token products with 2048x5632 and
#: 4096x4096 weights, the table in the commit that set it): the GEMM of a tile is as fast
#: per flop as the whole weight's once a tile holds about 512 rows (a narrower one re-packs
#: the activations for fewer columns), which 8 MiB gives float32 weights of up to 4096
#: inputs and 16-bit ones of up to 8192; each tile also costs a hand-off between the
#: decode's and the BLAS's thread pools, which fewer, larger tiles pay less often.
TILE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Layout:
    """A weight of ``out_features x in_features`` in blocks of ``blocksize`` values, cut
    into tiles of ``rows`` rows (the last may be shorter)."""

    out_features: int
    in_features: int
    blocksize: int
    rows: int

    @property
    def whole(self) -> bool:
        """One tile: the weight is decoded whole."""
        return self.rows >= self.out_features

    def tiles(self) -> Iterator[tuple[int, int]]:
        for r0 in range(0, self.out_features, self.rows):
            yield r0, min(r0 + self.rows, self.out_features)

    def blocks(self, r0: int, r1: int) -> tuple[int, int]:
        """The blocks that hold rows ``r0:r1``: the first, and one past the last."""
        return r0 * self.in_features // self.blocksize, block_count(r1 * self.in_features, self.blocksize)


def tile_rows(out_features: int, in_features: int, blocksize: int, itemsize: int, tile_bytes: int | None = None) -> int:
    """Rows per tile: as many as ``tile_bytes`` (default :data:`TILE_BYTES`) of decoded
    values of ``itemsize`` bytes hold, rounded down to a multiple of the rows that start
    on a block (at least that many: a tile holds at least one block), at most the weight."""
    tile_bytes = TILE_BYTES if tile_bytes is None else tile_bytes
    step = blocksize // math.gcd(in_features, blocksize)
    fit = tile_bytes // (in_features * itemsize)
    return min(out_features, max(step, fit // step * step))


def _scales_consistent(state: QuantState, blocks: int) -> bool:
    absmax = state.absmax
    if absmax.dim() != 1 or absmax.numel() != blocks:
        return False
    inner = state.state2
    if inner is None:
        return True
    return (
        inner.state2 is None
        and inner.quant_type is None
        and absmax.dtype == torch.uint8
        and inner.absmax.dim() == 1
        and inner.absmax.numel() == block_count(blocks, inner.blocksize)
    )


def layout(B: torch.Tensor, state: QuantState, in_features: int, itemsize: int) -> Layout | None:
    """How a product of ``in_features`` columns with the weight held by ``B`` and
    ``state``, decoded into values of ``itemsize`` bytes, is tiled; None where the codes
    or the state are not what tiling slices (a wrong size, a non-contiguous weight):
    the caller decodes those whole, so that the ops refuse them with their own errors."""
    # The weight's sizes, as ints: under torch.compile the input's may be symbolic, and
    # tiles are cut by the weight's (which never change).
    if state.quant_type is not None:
        if state.shape is None or len(state.shape) != 2:
            return None
        out_features, columns = (int(size) for size in state.shape)
        sized = B.numel() * B.element_size() == packed_bytes(out_features * columns)
    else:
        if B.dim() != 2 or B.dtype != torch.uint8:
            return None
        out_features, columns = (int(size) for size in B.shape)
        sized = True
    if columns != in_features or out_features == 0 or not sized or not B.is_contiguous():
        return None
    if not _scales_consistent(state, block_count(out_features * columns, state.blocksize)):
        return None
    rows = tile_rows(out_features, columns, state.blocksize, itemsize)
    return Layout(out_features, columns, state.blocksize, rows)


def _scales(state: QuantState, b0: int, b1: int) -> torch.Tensor:
    """The float scales of blocks ``b0:b1``: a view of the absmax, or for a nested state
    those blocks' codes decoded (from the nested blocks that hold them) plus the offset,
    bit-equal to decoding the whole absmax."""
    if state.state2 is None:
        return state.absmax[b0:b1]
    inner = state.state2
    size = inner.blocksize
    n0, n1 = b0 // size * size, min(block_count(b1, size) * size, state.absmax.numel())
    decoded = ops.dequantize_blockwise(
        state.absmax[n0:n1], inner.absmax[n0 // size : block_count(n1, size)], inner.code, size, inner.dtype
    )
    decoded.add_(state.offset)  # in place: one buffer alive, not two
    return decoded[b0 - n0 : b1 - n0].float()


def _decode_dtype(state: QuantState, dtype: torch.dtype) -> torch.dtype:
    """Decoding into float32 and casting to ``dtype`` rounds each value once, as decoding
    into ``dtype`` does, so those decode into ``dtype`` directly; a narrower stored dtype
    is decoded into first and then cast, as bitsandbytes does."""
    return dtype if state.dtype in (dtype, torch.float32) else state.dtype


def decode_rows(
    B: torch.Tensor, state: QuantState, grid: Layout, r0: int, r1: int, dtype: torch.dtype, *, backward: bool = False
) -> torch.Tensor:
    """Rows ``r0:r1`` of the weight, ``(r1 - r0) x in_features`` in ``dtype``.

    ``backward`` slices the codes through other views: under torch.compile the common-
    subexpression pass would otherwise merge the backward's decode with the forward's,
    and keep every decoded tile alive from the forward to the backward."""
    start, stop = r0 * grid.in_features, r1 * grid.in_features
    b0, b1 = grid.blocks(r0, r1)
    scales = _scales(state, b0, b1)
    into = _decode_dtype(state, dtype)
    if state.quant_type is not None:
        packed = B.reshape(-1).view(torch.uint8)[start // 2 : packed_bytes(stop)]
        if backward:
            packed = packed.unsqueeze(1)
        tile = ops.dequantize_4bit(packed, scales, state.blocksize, state.quant_type, [r1 - r0, grid.in_features], into)
    else:
        codes = B.reshape(-1)[start:stop] if backward else B[r0:r1]
        tile = ops.dequantize_blockwise(codes, scales, state.code, state.blocksize, into)
        tile = tile.view(r1 - r0, grid.in_features)
    del scales
    return tile if into == dtype else tile.to(dtype)


def linear(
    A: torch.Tensor, B: torch.Tensor, state: QuantState, bias: torch.Tensor | None, grid: Layout
) -> torch.Tensor:
    """``A @ decode(B).T + bias`` in ``A``'s dtype, one tile of ``grid`` at a time. The
    output is allocated first and each tile's product written into its columns, so what
    is held above the output is one tile (and its scales), whatever the number of rows."""
    bias = None if bias is None else bias.to(A.dtype)
    if torch.compiler.is_compiling():
        # dynamo refuses ``out=`` a column slice; inductor plans the memory of its graph itself
        parts = [
            torch.nn.functional.linear(
                A, decode_rows(B, state, grid, r0, r1, A.dtype), None if bias is None else bias[r0:r1]
            )
            for r0, r1 in grid.tiles()
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    A2 = A.reshape(-1, grid.in_features)
    out = A2.new_empty(A2.shape[0], grid.out_features)
    if A2.shape[0]:
        for r0, r1 in grid.tiles():
            tile = decode_rows(B, state, grid, r0, r1, A.dtype)
            columns = out if grid.whole else out[:, r0:r1]
            if bias is None:  # what F.linear computes: mm of the flattened input, or addmm with a bias
                torch.mm(A2, tile.t(), out=columns)
            else:
                torch.addmm(bias[r0:r1], A2, tile.t(), out=columns)
            del tile  # before the next is decoded: one tile alive at a time
    return out.view(*A.shape[:-1], grid.out_features)


def grad_input(grad: torch.Tensor, B: torch.Tensor, state: QuantState, grid: Layout) -> torch.Tensor:
    """``grad @ decode(B)`` in ``grad``'s dtype, one tile of ``grid`` at a time: the
    input's gradient summed over the tiles of output features. In float16 / bfloat16
    each tile's partial product is added into a float32 accumulator and the sum rounded
    once (rounding a running sum in the gradient's dtype after every tile would add a
    rounding of the whole sum per tile); that accumulator and one partial product are
    held besides the tile."""
    if grid.whole:
        weight = decode_rows(B, state, grid, 0, grid.out_features, grad.dtype, backward=True)
        return grad.matmul(weight)
    grad2 = grad.reshape(-1, grid.out_features)
    exact = grad.dtype == torch.float32
    result = grad2.new_zeros(grad2.shape[0], grid.in_features, dtype=torch.float32)
    if grad2.shape[0]:
        for r0, r1 in grid.tiles():
            tile = decode_rows(B, state, grid, r0, r1, grad.dtype, backward=True)
            if exact:
                result.addmm_(grad2[:, r0:r1], tile)
            else:
                result.add_(torch.mm(grad2[:, r0:r1], tile))
            del tile
    result = result if exact else result.to(grad.dtype)
    return result.view(*grad.shape[:-1], grid.in_features)


def transient_bytes(
    shape: tuple[int, int],
    itemsize: int,
    blocksize: int,
    nested_blocksize: int = 0,
    tile_bytes: int | None = None,
) -> int:
    """The most bytes :func:`linear` holds above its output at once (tensors alive between
    ops, as :class:`tightfit.memory.LiveTensorBytes` counts them), for a weight of
    ``shape`` decoded into values of ``itemsize`` bytes: one decoded tile, and for a
    nested absmax (``nested_blocksize`` > 0) the float32 scales of the nested blocks
    that hold the tile's blocks, alive while it is decoded. The input's dtype is the
    weight's (or the weight was stored in float32); the bias's dtype is the input's."""
    out_features, in_features = shape
    if out_features == 0 or in_features == 0:
        return 0
    rows = tile_rows(out_features, in_features, blocksize, itemsize, tile_bytes)
    grid = Layout(out_features, in_features, blocksize, rows)
    peak = 0
    blocks = block_count(out_features * in_features, blocksize)
    for r0, r1 in grid.tiles():
        held = (r1 - r0) * in_features * itemsize
        if nested_blocksize:
            b0, b1 = grid.blocks(r0, r1)
            n0 = b0 // nested_blocksize * nested_blocksize
            n1 = min(block_count(b1, nested_blocksize) * nested_blocksize, blocks)
            held += 4 * (n1 - n0)
        peak = max(peak, held)
    return peak
