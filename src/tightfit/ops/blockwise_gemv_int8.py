"""The ``"int8"`` compute choice of the blockwise formats: ``gemv_4bit_int8`` for 4-bit
(NF4 / FP4) layers (``NF4Config(compute="int8")``) and ``gemv_blockwise_int8`` for 8-bit
blockwise ones (``Blockwise8Config(compute="int8")``).

They are not ``gemv_4bit`` and ``gemv_blockwise`` computed faster: they compute something
else, with a measured loss (docs/kernels.md). Each token's activations are quantized to
int8 per block of 32 along the input features (scale ``max|x| / 127``, rounded half to
even: llama.cpp's Q8_0), and meet the weight's codes in integer dot products. The 4-bit
table is rounded to int8 levels (``round(127 * table)``: NF4's 16 values move by at most
0.4% of the block's absmax); the 8-bit map to int16 levels (``round(32767 * code /
max|code|)``: each value moves by at most 1.5e-5 of the block's absmax, far below the
map's own steps), so for 8-bit the loss is the activations' alone. On CPUs that is several
times fewer instructions per weight than decoding to float32, so a one-token matmul keeps
up with memory (``native/gemv_4bit_int8.c``, ``native/gemv_8bit_int8.c``: AVX-512 VNNI,
AVX2, portable C).

The references are the specification: the dequantized int8 activations times the weight
decoded through the integer table, in float32; the native kernels sum exact integer
products over runs of a step and agree with them to the rounding of the sum order. Other
devices run the references. The gradient (for ``A`` only) treats the activation
quantization as the identity (straight-through).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tightfit.ops import _arg_checks as checks
from tightfit.ops._arg_checks import FLOAT_DTYPES
from tightfit.ops._cpu_gemv import bind_gemv_4bit_int8, bind_gemv_8bit_int8
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.blockwise import _code_for, _quantize_4bit_reference, _unpack
from tightfit.ops.blockwise_gemv import (
    _gemv_4bit_fake,
    _gemv_blockwise_cases,
    _gemv_blockwise_fake,
    _gemv_blockwise_setup_context,
    _nested,
    _scales,
)
from tightfit.ops.codes import QUANT_TYPES_4BIT, code_4bit, real_constant

__all__ = ["ACTIVATION_BLOCK", "gemv_4bit_int8", "gemv_blockwise_int8", "int16_table", "int8_table"]

#: Activations share one int8 scale per this many consecutive input features.
ACTIVATION_BLOCK = 32


@functools.cache
@real_constant
def int8_table(quant_type: str) -> torch.Tensor:
    """The 4-bit table of ``quant_type`` at int8 levels: ``round(127 * table)`` (int8, 16 values)."""
    return torch.round(code_4bit(quant_type).float() * 127).to(torch.int8)


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (rows x K, float32) as int8 levels per block of 32, dequantized: ``q * max / 127``."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x, (0, -cols % ACTIVATION_BLOCK)).reshape(rows, -1, ACTIVATION_BLOCK)
    amax = padded.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    levels = torch.nan_to_num(padded * inverse, nan=0.0).clamp(-127, 127).round()
    return (levels * (amax / 127)).reshape(rows, -1)[:, :cols]


def _int8_product(A: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The references' product: ``A``'s rows at their int8 levels times the decoded
    ``weight`` (out x in, float32), in float32, then in ``A``'s dtype and leading shape."""
    x = _quantized_activations(A.reshape(-1, weight.shape[1]).float())
    return (x @ weight.T).to(A.dtype).reshape(*A.shape[:-1], weight.shape[0])


def _int8_weight(B, shape, scales, blocksize, quant_type) -> torch.Tensor:
    """The weight decoded through the int8 table, float32: ``table8[code] * (absmax / 127)``."""
    rows, cols = shape
    codes = _unpack(B, rows * cols)
    per_element = scales.repeat_interleave(blocksize)[: rows * cols]
    return (int8_table(quant_type).to(B.device).float()[codes] * (per_element / 127)).reshape(rows, cols)


def _gemv_4bit_int8_reference(
    A: torch.Tensor,
    B: torch.Tensor,
    shape: list[int],
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    absmax2: torch.Tensor | None = None,
    code2: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    scales = _scales(absmax, absmax2, code2, nested_blocksize, offset)
    return _int8_product(A, _int8_weight(B, shape, scales, blocksize, quant_type))


def _gemv_4bit_int8_cpu(
    A, B, shape, absmax, blocksize, quant_type, absmax2=None, code2=None, nested_blocksize=256, offset=None
):
    nested = (absmax2, code2, nested_blocksize, offset)
    bound = bind_gemv_4bit_int8(B, shape, absmax, int8_table(quant_type), blocksize, nested)
    if bound is None:  # no native build (reported once): the reference
        return _gemv_4bit_int8_reference(A, B, shape, absmax, blocksize, quant_type, *nested)
    return bound.matmul(A)


def _gemv_4bit_int8_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(7)
    cases = []
    shapes = ((96, 128, 1, 64, False), (33, 65, 2, 32, False), (40, 256, 9, 128, True), (8, 512, 3, 64, True))
    for quant_type in QUANT_TYPES_4BIT:
        for dtype in FLOAT_DTYPES:
            for rows, cols, tokens, blocksize, nested in shapes:
                weight = torch.randn(rows, cols, generator=generator)
                packed, absmax = _quantize_4bit_reference(weight, blocksize, quant_type, torch.uint8)
                x = torch.randn(tokens, cols, generator=generator).to(dtype)
                scales = _nested(absmax, 32) if nested else (absmax,)
                name = f"{quant_type} {dtype} {tokens}x{cols} @ {rows}x{cols} blocks of {blocksize}{' nested' if nested else ''}"
                cases.append(Case(name, (x, packed, [rows, cols], scales[0], blocksize, quant_type, *scales[1:])))
    return cases


_GEMV_4BIT_INT8 = define_op(
    "gemv_4bit_int8",
    _gemv_4bit_int8_reference,
    fake=_gemv_4bit_fake,
    cases=_gemv_4bit_int8_cases,
    metric=1e-4,
    check=checks.gemv_4bit,
)


def _setup_context(ctx, inputs, output):
    A, B, shape, absmax, blocksize, quant_type, absmax2, code2, nested_blocksize, offset = inputs
    ctx.save_for_backward(B, absmax, absmax2, code2)
    ctx.decode = (blocksize, quant_type, shape, nested_blocksize, offset)


def _backward(ctx, grad):
    """Gradient for ``A`` only: ``grad @ W`` with W the int8-level weight the forward used
    (the activations' rounding passed straight through)."""
    B, absmax, absmax2, code2 = ctx.saved_tensors
    blocksize, quant_type, shape, nested_blocksize, offset = ctx.decode
    scales = _scales(absmax, absmax2, code2, nested_blocksize, offset)
    return grad @ _int8_weight(B, shape, scales, blocksize, quant_type).to(grad.dtype), *([None] * 9)


_GEMV_4BIT_INT8.custom_op.register_autograd(_backward, setup_context=_setup_context)
register_kernel("gemv_4bit_int8", "cpu", _gemv_4bit_int8_cpu, label="int8 dot products (native C, else reference)")


def gemv_4bit_int8(
    A: torch.Tensor,
    B: torch.Tensor,
    shape: Sequence[int],
    absmax: torch.Tensor,
    blocksize: int = 64,
    quant_type: str = "nf4",
    absmax2: torch.Tensor | None = None,
    code2: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A @ W.T`` for a packed 4-bit weight of ``shape`` (out x in), with ``A`` quantized to
    int8 per block of 32 and W decoded through the int8 table (:func:`int8_table`): the
    ``"int8"`` compute choice, faster on CPUs and measurably less exact than
    :func:`tightfit.ops.gemv_4bit`. Arguments as for ``gemv_4bit``; any number of rows."""
    return _GEMV_4BIT_INT8(A, B, shape, absmax, blocksize, quant_type, absmax2, code2, nested_blocksize, offset)


# -- gemv_blockwise_int8 ---------------------------------------------------------------------

#: The 8-bit map's largest magnitude becomes this int16 level.
INT16_PEAK = 32767


def int16_table(code: torch.Tensor) -> tuple[torch.Tensor, float]:
    """An 8-bit code map at int16 levels, ``round(code * 32767 / max|code|)`` (256 values),
    and the unit that turns a level back into a map value, ``max|code| / 32767`` (a float32
    value; 0 for a map of zeros)."""
    values = code.detach().float().cpu()
    peak = float(values.abs().max()) if values.numel() else 0.0
    if not peak > 0:  # zeros (or NaN): every level 0
        return torch.zeros(values.shape, dtype=torch.int16), 0.0
    levels = torch.round(values * (INT16_PEAK / peak)).clamp(-INT16_PEAK, INT16_PEAK).to(torch.int16)
    return levels, float(torch.tensor(peak / INT16_PEAK, dtype=torch.float32))


def _int16_weight(B: torch.Tensor, scales: torch.Tensor, code: torch.Tensor, blocksize: int) -> torch.Tensor:
    """The 8-bit weight decoded through the int16 table, float32: ``level[code] * (absmax * unit)``."""
    levels, unit = int16_table(code)
    rows, cols = B.shape
    per_element = (scales.float() * unit).repeat_interleave(blocksize)[: rows * cols]
    return (levels.to(B.device).float()[B.reshape(-1).long()] * per_element).reshape(rows, cols)


def _gemv_blockwise_int8_reference(
    A: torch.Tensor,
    B: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    blocksize: int,
    absmax2: torch.Tensor | None = None,
    code2: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    scales = _scales(absmax, absmax2, code2, nested_blocksize, offset)
    return _int8_product(A, _int16_weight(B, scales, code, blocksize))


def _gemv_blockwise_int8_cpu(
    A, B, absmax, code, blocksize, absmax2=None, code2=None, nested_blocksize=256, offset=None
):
    nested = (absmax2, code2, nested_blocksize, offset)
    bound = bind_gemv_8bit_int8(B, B.shape, absmax, *int16_table(code), blocksize, nested)
    if bound is None:  # no native build (reported once): the reference
        return _gemv_blockwise_int8_reference(A, B, absmax, code, blocksize, *nested)
    return bound.matmul(A)


_GEMV_BLOCKWISE_INT8 = define_op(
    "gemv_blockwise_int8",
    _gemv_blockwise_int8_reference,
    fake=_gemv_blockwise_fake,
    cases=_gemv_blockwise_cases,  # the float op's cases: the same arguments
    metric=1e-4,
    check=checks.gemv_blockwise,
)


def _blockwise_backward(ctx, grad):
    """Gradient for ``A`` only: ``grad @ W`` with W the int16-level weight the forward used
    (the activations' rounding passed straight through); saved as ``gemv_blockwise`` saves."""
    B, absmax, code, absmax2, code2 = ctx.saved_tensors
    blocksize, nested_blocksize, offset = ctx.decode
    scales = _scales(absmax, absmax2, code2, nested_blocksize, offset)
    return grad @ _int16_weight(B, scales, code, blocksize).to(grad.dtype), *([None] * 8)


_GEMV_BLOCKWISE_INT8.custom_op.register_autograd(_blockwise_backward, setup_context=_gemv_blockwise_setup_context)
register_kernel(
    "gemv_blockwise_int8", "cpu", _gemv_blockwise_int8_cpu, label="int8 x int16 dot products (native C, else reference)"
)


def gemv_blockwise_int8(
    A: torch.Tensor,
    B: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor | None = None,
    blocksize: int = 4096,
    absmax2: torch.Tensor | None = None,
    code2: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A @ W.T`` for 8-bit blockwise codes ``B`` (out x in, uint8), with ``A`` quantized to
    int8 per block of 32 and W decoded through the int16 table (:func:`int16_table`): the
    ``"int8"`` compute choice of 8-bit layers, faster on CPUs and measurably less exact
    than :func:`tightfit.ops.gemv_blockwise`. Arguments as for ``gemv_blockwise``; any
    number of rows."""
    return _GEMV_BLOCKWISE_INT8(A, B, absmax, _code_for(code, A), blocksize, absmax2, code2, nested_blocksize, offset)
