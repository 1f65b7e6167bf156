"""Few-token matmuls against blockwise-quantized weights, the weight never decoded whole:
``gemv_4bit`` (NF4 / FP4, packed) and ``gemv_blockwise`` (8-bit codes).

Both take the block scales as stored: float ``absmax``, or double-quantized (``absmax``
as uint8 codes, with ``absmax2``, ``code2``, ``nested_blocksize`` and ``offset``, decoded
as ``code2[absmax] * absmax2[i // nested_blocksize] + offset``), so a one-token forward
does not first decode a float copy of the scales.

The reference decodes the weight in ``A``'s dtype and calls ``F.linear``. The CPU kernels
read each code byte once through the native kernels (``native/gemv_blockwise.c``), the
decoded weight in float32 exactly as the reference computes it before its cast, products
summed in float32 (results agree with the reference to the rounding of the sum order and
of the reference's cast: the conformance metric). Without a native build, 4-bit runs the
numba kernel and 8-bit decodes and multiplies. Triton kernels serve 4-bit on GPUs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from tightfit.ops import _arg_checks as checks
from tightfit.ops import _cpu_blockwise as cpu
from tightfit.ops._arg_checks import FLOAT_DTYPES
from tightfit.ops._cpu_gemv import bind_gemv_blockwise
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.blockwise import (
    _DEQUANTIZE_4BIT,
    _code_for,
    _code_on,
    _dequantize_4bit_reference,
    _dequantize_blockwise_reference,
    _quantize_4bit_reference,
    _quantize_blockwise_reference,
    _triton,
    dequantize_blockwise,
)
from tightfit.ops.codes import QUANT_TYPES_4BIT, code_4bit, dynamic_map

__all__ = ["FEW_TOKENS", "gemv_4bit", "gemv_blockwise"]

#: Up to this many rows (tokens) a quantized layer's forward runs these kernels, which read
#: the codes in the product; more rows amortize a decode and a GEMM better (CPU and GPU).
FEW_TOKENS = 8


def _scales(absmax, absmax2, code2, nested_blocksize, offset) -> torch.Tensor:
    """The float32 block scales, decoded where they are double-quantized (the reference's order)."""
    if absmax2 is None:
        return absmax.float()
    return _dequantize_blockwise_reference(absmax, absmax2, code2, nested_blocksize, torch.float32) + offset


# -- gemv_4bit ---------------------------------------------------------------------------


def _gemv_4bit_reference(
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
    weight = _dequantize_4bit_reference(B, scales, blocksize, quant_type, shape, A.dtype)
    return torch.nn.functional.linear(A, weight)


def _gemv_4bit_fake(
    A, B, shape, absmax, blocksize, quant_type, absmax2=None, code2=None, nested_blocksize=256, offset=0.0
):
    return torch.empty(*A.shape[:-1], shape[0], dtype=A.dtype, device=A.device)


def _gemv_4bit_cpu(
    A, B, shape, absmax, blocksize, quant_type, absmax2=None, code2=None, nested_blocksize=256, offset=0.0
):
    nested = (absmax2, code2, nested_blocksize, offset)
    bound = bind_gemv_blockwise(B, 4, shape, absmax, code_4bit(quant_type), blocksize, "gemv_4bit", nested)
    if bound is not None:
        return bound.matmul(A)
    scales = _scales(absmax, *nested)
    return cpu.gemv_4bit_cpu(
        A,
        B,
        shape,
        scales,
        code_4bit(quant_type),
        blocksize,
        lambda: _gemv_4bit_reference(A, B, shape, scales, blocksize, quant_type),
    )


def _gemv_4bit_gpu(
    A, B, shape, absmax, blocksize, quant_type, absmax2=None, code2=None, nested_blocksize=256, offset=0.0
):
    code = _code_on(quant_type, A.device)
    scales = _scales(absmax, absmax2, code2, nested_blocksize, offset)
    if A.numel() // shape[1] <= FEW_TOKENS and shape[1] % 2 == 0:  # rows start on a byte
        return _triton().gemv(A, B, shape, scales, code, blocksize, four_bit=True)
    weight = _triton().dequantize(B, scales, code, blocksize, shape, A.dtype, four_bit=True)
    return torch.nn.functional.linear(A, weight)


def _nested(scales: torch.Tensor, nested_blocksize: int) -> tuple:
    """``scales`` double-quantized as QuantState does it: (codes, absmax2, code2, nested_blocksize, offset)."""
    offset = scales.mean()
    codes, absmax2 = _quantize_blockwise_reference(scales - offset, dynamic_map(), nested_blocksize)
    return codes, absmax2, dynamic_map(), nested_blocksize, offset.reshape(())


def _gemv_4bit_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(5)
    cases = []
    for quant_type in QUANT_TYPES_4BIT:
        for dtype in FLOAT_DTYPES:
            for rows, cols, tokens, nested in ((96, 64, 1, False), (33, 65, 1, False), (40, 256, 3, True)):
                weight = torch.randn(rows, cols, generator=generator)
                packed, absmax = _quantize_4bit_reference(weight, 64, quant_type, torch.uint8)
                x = torch.randn(tokens, cols, generator=generator).to(dtype)
                scales = _nested(absmax, 32) if nested else (absmax,)
                name = f"{quant_type} {dtype} {tokens}x{cols} @ {rows}x{cols}{' nested' if nested else ''}"
                cases.append(Case(name, (x, packed, [rows, cols], scales[0], 64, quant_type, *scales[1:])))
    return cases


_GEMV_4BIT = define_op(
    "gemv_4bit", _gemv_4bit_reference, fake=_gemv_4bit_fake, cases=_gemv_4bit_cases, metric=1e-4, check=checks.gemv_4bit
)


def _gemv_4bit_setup_context(ctx, inputs, output):
    A, B, shape, absmax, blocksize, quant_type, absmax2, code2, nested_blocksize, offset = inputs
    ctx.save_for_backward(B, absmax, absmax2, code2)
    ctx.decode = (blocksize, quant_type, shape, nested_blocksize, offset)


def _gemv_4bit_backward(ctx, grad):
    """Gradient for ``A`` only (QLoRA): ``grad @ W``, W decoded in the gradient's dtype; the
    packed weight and its scales are frozen data, never trained."""
    B, absmax, absmax2, code2 = ctx.saved_tensors
    blocksize, quant_type, shape, nested_blocksize, offset = ctx.decode
    scales = _scales(absmax, absmax2, code2, nested_blocksize, offset)
    weight = _DEQUANTIZE_4BIT.custom_op(B, scales, blocksize, quant_type, shape, grad.dtype)
    return grad @ weight, *([None] * 9)


_GEMV_4BIT.custom_op.register_autograd(_gemv_4bit_backward, setup_context=_gemv_4bit_setup_context)
register_kernel("gemv_4bit", "cpu", _gemv_4bit_cpu, label="fused decode + dot (native C, else numba)")
if importlib.util.find_spec("triton") is not None:  # checked without importing it (D2)
    register_kernel("gemv_4bit", "cuda", _gemv_4bit_gpu, label="fused decode + dot (triton)")


# -- gemv_blockwise ------------------------------------------------------------------------


def _gemv_blockwise_reference(
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
    weight = _dequantize_blockwise_reference(B, scales, code, blocksize, A.dtype)
    return torch.nn.functional.linear(A, weight)


def _gemv_blockwise_fake(A, B, absmax, code, blocksize, absmax2=None, code2=None, nested_blocksize=256, offset=None):
    return A.new_empty(*A.shape[:-1], B.shape[0])


def _gemv_blockwise_cpu(A, B, absmax, code, blocksize, absmax2=None, code2=None, nested_blocksize=256, offset=None):
    nested = (absmax2, code2, nested_blocksize, offset)
    bound = bind_gemv_blockwise(B, 8, B.shape, absmax, code, blocksize, "gemv_blockwise", nested)
    if bound is None:  # no native build: decode with the numba kernel, then one GEMM
        weight = dequantize_blockwise(B, _scales(absmax, *nested), code, blocksize, A.dtype)
        return torch.nn.functional.linear(A, weight)
    return bound.matmul(A)


def _gemv_blockwise_gpu(A, B, absmax, code, blocksize, absmax2=None, code2=None, nested_blocksize=256, offset=None):
    scales = _scales(absmax, absmax2, code2, nested_blocksize, offset)
    if A.numel() // B.shape[1] <= FEW_TOKENS:
        return _triton().gemv(A, B, B.shape, scales, code, blocksize, four_bit=False)
    weight = _triton().dequantize(B, scales, code, blocksize, list(B.shape), A.dtype, four_bit=False)
    return torch.nn.functional.linear(A, weight)


def _gemv_blockwise_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(7)
    cases = []
    shapes = ((96, 64, 1, 64, False), (33, 65, 1, 64, True), (40, 256, 3, 4096, False), (24, 96, 9, 1000, False))
    for dtype in FLOAT_DTYPES:
        for rows, cols, tokens, blocksize, nested in shapes:
            weight = torch.randn(rows, cols, generator=generator)
            codes, absmax = _quantize_blockwise_reference(weight, dynamic_map(), blocksize)
            x = torch.randn(tokens, cols, generator=generator).to(dtype)
            scales = _nested(absmax, 16) if nested else (absmax,)
            name = f"{dtype} {tokens}x{cols} @ {rows}x{cols} bs{blocksize}{' nested' if nested else ''}"
            cases.append(Case(name, (x, codes, scales[0], dynamic_map(), blocksize, *scales[1:])))
    return cases


_GEMV_BLOCKWISE = define_op(
    "gemv_blockwise",
    _gemv_blockwise_reference,
    fake=_gemv_blockwise_fake,
    cases=_gemv_blockwise_cases,
    metric=1e-4,
    check=checks.gemv_blockwise,
)


def _gemv_blockwise_setup_context(ctx, inputs, output):
    A, B, absmax, code, blocksize, absmax2, code2, nested_blocksize, offset = inputs
    ctx.save_for_backward(B, absmax, code, absmax2, code2)
    ctx.decode = (blocksize, nested_blocksize, offset)


def _gemv_blockwise_backward(ctx, grad):
    """Gradient for ``A`` only: ``grad @ W``, W decoded in the gradient's dtype (the codes
    and scales are frozen data)."""
    B, absmax, code, absmax2, code2 = ctx.saved_tensors
    blocksize, nested_blocksize, offset = ctx.decode
    weight = dequantize_blockwise(
        B, _scales(absmax, absmax2, code2, nested_blocksize, offset), code, blocksize, grad.dtype
    )
    return grad @ weight, *([None] * 8)


_GEMV_BLOCKWISE.custom_op.register_autograd(_gemv_blockwise_backward, setup_context=_gemv_blockwise_setup_context)
register_kernel("gemv_blockwise", "cpu", _gemv_blockwise_cpu, label="fused decode + dot (native C)")
if importlib.util.find_spec("triton") is not None:
    register_kernel("gemv_blockwise", "cuda", _gemv_blockwise_gpu, label="fused decode + dot (triton)")


# -- public functions -----------------------------------------------------------------------


def gemv_4bit(
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
    """``A @ dequantize(B).T`` for a packed 4-bit weight of ``shape`` (out x in), decoding
    the weight block by block instead of materializing it: the few-token case.

    ``A`` has shape (..., in); the result (..., out) has ``A``'s dtype. Double-quantized
    scales: ``absmax`` holds their uint8 codes, decoded with ``absmax2``, ``code2`` (256
    float32), ``nested_blocksize`` and ``offset`` (a float32 tensor of one value). The CPU kernel accumulates in float32,
    so results agree with the reference to rounding."""
    return _GEMV_4BIT(A, B, shape, absmax, blocksize, quant_type, absmax2, code2, nested_blocksize, offset)


def gemv_blockwise(
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
    """``A @ dequantize_blockwise(B).T`` for 8-bit codes ``B`` (out x in, uint8), decoding
    the weight block by block in the product instead of materializing it (few tokens).

    ``A`` has shape (..., in); the result (..., out) has ``A``'s dtype. ``code`` defaults
    to the dynamic map; double-quantized scales as for :func:`gemv_4bit`."""
    return _GEMV_BLOCKWISE(A, B, absmax, _code_for(code, A), blocksize, absmax2, code2, nested_blocksize, offset)
