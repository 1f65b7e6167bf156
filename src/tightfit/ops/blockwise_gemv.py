"""``gemv_blockwise``: few-token matmuls against an 8-bit blockwise weight, the weight
never decoded whole (the 8-bit counterpart of ``gemv_4bit``).

The reference decodes the weight in ``A``'s dtype and calls ``F.linear``; the CPU kernel
reads each code byte once through the native kernels (``native/gemv_blockwise.c``),
accumulating in float32 (results agree with the reference to rounding of the sum order:
the conformance metric). Other devices run the reference (decode, then a GEMM).
"""

from __future__ import annotations

import torch

from tightfit.ops import _arg_checks as checks
from tightfit.ops._cpu_gemv import gemv_blockwise as native_gemv
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.blockwise import (
    _code_for,
    _dequantize_blockwise_reference,
    _quantize_blockwise_reference,
    dequantize_blockwise,
)
from tightfit.ops.codes import dynamic_map

__all__ = ["gemv_blockwise"]


def _reference(
    A: torch.Tensor, B: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int
) -> torch.Tensor:
    weight = _dequantize_blockwise_reference(B, absmax, code, blocksize, A.dtype)
    return torch.nn.functional.linear(A, weight)


def _fake(A, B, absmax, code, blocksize):
    return A.new_empty(*A.shape[:-1], B.shape[0])


def _cpu(A, B, absmax, code, blocksize):
    out = native_gemv(A, B, 8, B.shape, absmax, code, blocksize, "gemv_blockwise")
    if out is None:  # no native build: decode with the numba kernel, then one GEMM
        weight = dequantize_blockwise(B, absmax, code, blocksize, A.dtype)
        return torch.nn.functional.linear(A, weight)
    return out.to(A.dtype).reshape(*A.shape[:-1], B.shape[0])


def _cases() -> list[Case]:
    generator = torch.Generator().manual_seed(7)
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows, cols, tokens, blocksize in ((96, 64, 1, 64), (33, 65, 1, 64), (40, 256, 3, 4096), (24, 96, 9, 1000)):
            weight = torch.randn(rows, cols, generator=generator)
            codes, absmax = _quantize_blockwise_reference(weight, dynamic_map(), blocksize)
            x = torch.randn(tokens, cols, generator=generator).to(dtype)
            name = f"{dtype} {tokens}x{cols} @ {rows}x{cols} bs{blocksize}"
            cases.append(Case(name, (x, codes, absmax, dynamic_map(), blocksize)))
    return cases


_GEMV_BLOCKWISE = define_op(
    "gemv_blockwise", _reference, fake=_fake, cases=_cases, metric=1e-4, check=checks.gemv_blockwise
)


def _setup_context(ctx, inputs, output):
    A, B, absmax, code, blocksize = inputs
    ctx.save_for_backward(B, absmax, code)
    ctx.blocksize = blocksize


def _backward(ctx, grad):
    """Gradient for ``A`` only: ``grad @ W``, W decoded in the gradient's dtype (the codes
    and scales are frozen data)."""
    B, absmax, code = ctx.saved_tensors
    weight = dequantize_blockwise(B, absmax, code, ctx.blocksize, grad.dtype)
    return grad @ weight, None, None, None, None


_GEMV_BLOCKWISE.custom_op.register_autograd(_backward, setup_context=_setup_context)
register_kernel("gemv_blockwise", "cpu", _cpu, label="fused decode + dot (native C)")


def gemv_blockwise(
    A: torch.Tensor,
    B: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor | None = None,
    blocksize: int = 4096,
) -> torch.Tensor:
    """``A @ dequantize_blockwise(B).T`` for 8-bit codes ``B`` (out x in, uint8), decoding
    the weight block by block in the product instead of materializing it (few tokens).

    ``A`` has shape (..., in); the result (..., out) has ``A``'s dtype. ``code`` defaults
    to the dynamic map."""
    return _GEMV_BLOCKWISE(A, B, absmax, _code_for(code, A), blocksize)
