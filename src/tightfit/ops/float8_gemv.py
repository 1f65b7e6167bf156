"""``gemv_float8``: few-token matmuls against a float8 weight (layerwise casting's storage),
the weight never upcast whole.

The reference is the specification: the upcast layerwise casting does before a forward
(:func:`upcast_float8`: the weight converted to ``A``'s dtype, times its scale converted to
that dtype), then ``F.linear``. The CPU kernel (``native/gemv_float8.c``) reads each stored
byte once for up to ``MAX_TOKENS`` rows of ``A``, decoding in registers and accumulating
in float32; its results agree with the reference to the rounding of the sum's order (the
conformance metric, normalized MSE 1e-4). More rows, other devices, or no native build run
the reference (upcast, then one GEMM).
"""

from __future__ import annotations

import math

import torch

from tightfit._strict import report_fallback
from tightfit._validate import check_same_device, check_type
from tightfit.ops import _native
from tightfit.ops._arg_checks import FLOAT_DTYPES, check_float_input
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.blockwise_gemv import FEW_TOKENS

__all__ = ["FLOAT8_FORMATS", "gemv_float8", "upcast_float8"]

#: The float8 kinds the op reads, and the format number the native kernel knows each by.
FLOAT8_FORMATS: dict[torch.dtype, int] = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
#: The least magnitude each compute dtype rounds to infinity: the upcast's scaled weights past
#: it are infinite (a float16 upcast of an e5m2 weight times 2, for one).
_CEILING = {torch.float32: math.inf, torch.float16: 65520.0, torch.bfloat16: 2.0**128 - 2.0**119}
#: Up to this many rows of ``A`` the fused kernel runs (the planner prices such forwards by
#: the one-token figures); more amortize an upcast and a GEMM better.
MAX_TOKENS = FEW_TOKENS


def upcast_float8(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype``, times ``scale`` converted to ``dtype`` (layerwise casting's upcast)."""
    upcast = weight.to(dtype)
    if scale is not None:
        upcast.mul_(scale if scale.dtype == dtype else scale.to(dtype))
    return upcast


def _reference(
    A: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.nn.functional.linear(A, upcast_float8(weight, scale, A.dtype), bias)


def _fake(A, weight, scale, bias):
    return A.new_empty(*A.shape[:-1], weight.shape[0])


def _check(A: object, weight: object, scale: object, bias: object) -> None:
    """What the kernels rely on (D9): dtypes, a 2-D contiguous weight, matching shapes, one device."""
    check_float_input("A", A)
    check_type("weight", weight, torch.Tensor)
    if weight.dtype not in FLOAT8_FORMATS:
        raise TypeError(f"weight must be float8_e4m3fn or float8_e5m2, got dtype {weight.dtype}")
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous 2-D tensor (out_features x in_features), got shape {tuple(weight.shape)} "
            f"with strides {weight.stride()}"
        )
    out_features, in_features = weight.shape
    if A.dim() < 1 or A.shape[-1] != in_features:
        raise ValueError(
            f"A has shape {tuple(A.shape)}; its last dimension must be the weight's in_features, {in_features}"
        )
    check_same_device("weight", weight, "A", A)
    if scale is not None:
        check_type("scale", scale, torch.Tensor)
        if scale.dtype not in FLOAT_DTYPES:
            raise TypeError(f"scale must be float32, float16 or bfloat16, got dtype {scale.dtype}")
        per_tensor = scale.numel() == 1 and scale.dim() <= 2
        if not per_tensor and tuple(scale.shape) != (out_features, 1):
            raise ValueError(
                f"scale must hold one value (shape (), (1,) or (1, 1)) or one a row (shape ({out_features}, 1)), "
                f"got shape {tuple(scale.shape)}"
            )
        check_same_device("scale", scale, "A", A)
    if bias is not None:
        check_type("bias", bias, torch.Tensor)
        if bias.dtype != A.dtype or tuple(bias.shape) != (out_features,):
            raise ValueError(
                f"bias must be {str(A.dtype).removeprefix('torch.')} (A's dtype) of shape ({out_features},), "
                f"got {bias.dtype} {tuple(bias.shape)}"
            )
        check_same_device("bias", bias, "A", A)


def _native_library():
    """The native kernels' library, or None after reporting once why not (D1; not where
    ``TIGHTFIT_CPU_KERNEL_PATH=none`` asks for no native kernels)."""
    library, path_or_reason = _native.library()
    if library is None and _native.pinned_path() != "none":
        report_fallback("gemv_float8", "cpu", "native", f"{path_or_reason}; upcasting the weight for one GEMM")
    return library


def _cpu(A, weight, scale, bias):
    out_features, in_features = weight.shape
    rows = math.prod(A.shape[:-1])
    if not 0 < rows <= MAX_TOKENS or in_features == 0 or out_features == 0:
        return _reference(A, weight, scale, bias)
    library = _native_library()
    if library is None:
        return _reference(A, weight, scale, bias)
    x = A.reshape(rows, in_features).contiguous()  # in A's dtype: the kernel converts it, and bias
    # the scale as the reference applies it: rounded to A's dtype first
    scales = None if scale is None else scale.to(A.dtype).float().reshape(-1).contiguous()
    shift = None if bias is None else bias.contiguous()
    out = torch.empty(rows, out_features, dtype=A.dtype)
    library.tf_gemv_float8(
        x.data_ptr(),
        weight.data_ptr(),
        FLOAT8_FORMATS[weight.dtype],
        None if scales is None else scales.data_ptr(),
        0 if scales is None else scales.numel(),
        _CEILING[A.dtype],
        None if shift is None else shift.data_ptr(),
        rows,
        out_features,
        in_features,
        out.data_ptr(),
        torch.get_num_threads(),
        _native.DTYPE_CODES[A.dtype],
    )
    return out.reshape(*A.shape[:-1], out_features)


def _cases() -> list[Case]:
    generator = torch.Generator().manual_seed(8)
    cases = []
    shapes = ((96, 64, (1,)), (33, 65, (3,)), (40, 256, (2, 4)), (24, 96, (9,)), (7, 1, (1,)))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for fmt in FLOAT8_FORMATS:
            for rows, cols, tokens in shapes:
                weight = (torch.randn(rows, cols, generator=generator) * 40).to(fmt)
                x = torch.randn(*tokens, cols, generator=generator).to(dtype)
                scales = {
                    "none": None,
                    "tensor": torch.tensor(2.0**-6),
                    "channel": torch.ldexp(torch.ones(rows, 1), torch.randint(-12, 4, (rows, 1), generator=generator)),
                }
                for label, scale in scales.items():
                    bias = torch.randn(rows, generator=generator).to(dtype) if label == "channel" else None
                    name = f"{dtype} {fmt} {tokens}x{cols} @ {rows}x{cols} scale {label}"
                    cases.append(Case(name, (x, weight, scale, bias)))
    # every exponent, both zeros, subnormals and the largest values (NaN and inf: tests/ops/test_float8_gemv.py)
    for fmt, largest in ((torch.float8_e4m3fn, 0x7E), (torch.float8_e5m2, 0x7B)):
        codes = torch.arange(largest + 1, dtype=torch.int32).to(torch.uint8)
        weight = torch.cat([codes, codes | 0x80]).view(fmt).reshape(2, -1)
        x = torch.randn(2, weight.shape[1], generator=generator)
        cases.append(Case(f"{fmt} every finite value", (x, weight, torch.tensor([[0.5], [2.0]]), None)))
    return cases


_GEMV_FLOAT8 = define_op("gemv_float8", _reference, fake=_fake, cases=_cases, metric=1e-4, check=_check)


def _setup_context(ctx, inputs, output):
    A, weight, scale, bias = inputs
    ctx.save_for_backward(weight, scale)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    """Gradients for ``A`` (``grad @ W``, W upcast in the gradient's dtype) and ``bias``; the
    stored weight and its scale are frozen data."""
    weight, scale = ctx.saved_tensors
    grad_A = grad @ upcast_float8(weight, scale, grad.dtype) if ctx.needs_input_grad[0] else None
    grad_bias = grad.reshape(-1, weight.shape[0]).sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
    return grad_A, None, None, grad_bias


_GEMV_FLOAT8.custom_op.register_autograd(_backward, setup_context=_setup_context)
register_kernel("gemv_float8", "cpu", _cpu, label="fused float8 decode + dot (native C)")


def gemv_float8(
    A: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``A @ (weight * scale).T + bias`` for a float8 ``weight`` (out x in, float8_e4m3fn or
    float8_e5m2) stored by layerwise casting, reading the weight once instead of upcasting it
    (few rows). ``scale``: None, one value, or one per row (shape (out, 1)); ``bias``: None
    or (out,) in ``A``'s dtype. ``A`` has shape (..., in); the result (..., out) has
    ``A``'s dtype. Differentiable in ``A`` and ``bias``."""
    return _GEMV_FLOAT8(A, weight, scale, bias)
