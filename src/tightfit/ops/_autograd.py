"""``int8_linear``: LLM.int8()'s whole linear (quantize the input per row, int8 matmul,
dequantize, outlier columns in the input's dtype) as one op, so it has a backward.

Rounding has no useful derivative, so the int8 ops themselves have none; like
bitsandbytes' ``MatMul8bitLt``, the gradient of the whole product is taken against the
dequantized weight (straight through the input's quantization): ``grad @ W`` for the
input and the summed gradient for the bias. The weight stays frozen (QLoRA).
"""

from __future__ import annotations

import torch

from tightfit._validate import check_non_negative_number, check_same_device, check_type
from tightfit.ops import _cpu_int8_rows, int8
from tightfit.ops._arg_checks import FLOAT_DTYPES
from tightfit.ops._cpu_int8 import linear_matmul_gathering
from tightfit.ops._cpu_int8_rows import vectorwise_quant_cpu
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.int8 import (
    int8_linear_matmul,
    int8_mm_dequant,
    int8_vectorwise_dequant,
    int8_vectorwise_quant,
)

__all__ = ["int8_linear"]


def _int8_linear_reference(
    A: torch.Tensor, weight: torch.Tensor, SCB: torch.Tensor, bias: torch.Tensor | None, threshold: float
) -> torch.Tensor:
    rows = A.reshape(-1, weight.shape[1])
    q, row_scales, outlier_cols = int8_vectorwise_quant(rows, threshold)
    product = int8_linear_matmul(q, weight)
    out = int8_mm_dequant(product, row_scales, SCB, A.dtype, None if bias is None else bias.to(A.dtype))
    if outlier_cols is not None and outlier_cols.numel():
        weight_cols = int8_vectorwise_dequant(weight[:, outlier_cols].contiguous(), SCB).to(A.dtype)
        out = out.addmm(rows[:, outlier_cols], weight_cols.t())
    return out.reshape(*A.shape[:-1], weight.shape[0])


def _int8_linear_fake(A, weight, SCB, bias, threshold):
    return A.new_empty(*A.shape[:-1], weight.shape[0])


def _check_int8_linear(A: object, weight: object, SCB: object, bias: object, threshold: object) -> None:
    check_type("A", A, torch.Tensor)
    check_type("weight", weight, torch.Tensor)
    check_type("SCB", SCB, torch.Tensor)
    if A.dtype not in FLOAT_DTYPES or A.dim() < 1:
        raise TypeError(f"A must be a float32, float16 or bfloat16 tensor of rows, got {A.dtype} {tuple(A.shape)}")
    if weight.dtype != torch.int8 or weight.dim() != 2 or A.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be int8 (out x {A.shape[-1]}) for A {tuple(A.shape)}, got {weight.dtype} {tuple(weight.shape)}"
        )
    if SCB.dtype != torch.float32 or SCB.shape != (weight.shape[0],):
        raise ValueError(f"SCB must be float32 of shape ({weight.shape[0]},), got {SCB.dtype} {tuple(SCB.shape)}")
    check_same_device("weight", weight, "A", A)
    check_same_device("SCB", SCB, "A", A)
    if bias is not None:
        check_type("bias", bias, torch.Tensor)
        if bias.shape != (weight.shape[0],) or bias.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"bias must be float32, float16 or bfloat16 of shape ({weight.shape[0]},), got {bias.dtype} {tuple(bias.shape)}"
            )
        check_same_device("bias", bias, "A", A)
    check_non_negative_number("threshold", threshold)


def _cases() -> list[Case]:
    generator = torch.Generator().manual_seed(3)
    A = torch.randn(5, 64, generator=generator)
    A[1, 9] = 12.0  # an outlier column at threshold 6
    weight = torch.randint(-127, 128, (24, 64), generator=generator, dtype=torch.int8)
    SCB = torch.rand(24, generator=generator) + 0.5
    bias = torch.randn(24, generator=generator)
    return [
        Case(f"{dtype} t={t} bias={b}", (A.to(dtype), weight, SCB, bias if b else None, t))
        for dtype in (torch.float32, torch.bfloat16)
        for t in (0.0, 6.0)
        for b in (False, True)
    ]


def _int8_linear_cpu(
    A: torch.Tensor, weight: torch.Tensor, SCB: torch.Tensor, bias: torch.Tensor | None, threshold: float
) -> torch.Tensor:
    """The reference's steps, each step's CPU kernel called directly where the dispatcher would
    add nothing (no dispatch or function mode active, not tracing): int8_linear's check has
    covered the arguments and what one step hands the next is valid by construction, so the
    steps' own checks and dispatch, a fifth of a one-token call, are left out. The same
    kernels, bits and allocations; the same error for NaN or inf. Up to 8 rows without an
    outlier column, the three steps run in one native call (``_cpu_int8_rows.linear_rows``)."""
    if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack() or torch.compiler.is_compiling():
        return _int8_linear_reference(A, weight, SCB, bias, threshold)
    rows = A.reshape(-1, weight.shape[1])
    fused = _cpu_int8_rows.linear_rows(rows, weight, SCB, bias, threshold, A.dtype)
    if fused is not None:
        return fused.reshape(*A.shape[:-1], weight.shape[0])

    def checked_reference():
        """Where the quantizer met NaN or inf (or cannot run): the finiteness check, a pass of
        its own that finite input skips, then the reference."""
        int8._check_finite(rows)
        return int8._vectorwise_reference(rows, threshold)

    if rows.numel():
        q, row_scales, outlier_cols = vectorwise_quant_cpu(rows, threshold, checked_reference)
    else:
        q, row_scales, outlier_cols = int8._vectorwise_cpu(rows, threshold)
    outliers = threshold > 0.0 and outlier_cols.numel() > 0
    if outliers and q.numel() and weight.shape[0]:  # the outlier columns of the weight taken in the product's pass
        product, gathered = linear_matmul_gathering(q, weight, outlier_cols)
    else:
        product, gathered = int8._linear_matmul_cpu(q, weight), None
    out = int8._mm_dequant_cpu(product, row_scales, SCB, A.dtype, None if bias is None else bias.to(A.dtype))
    if outliers:
        columns = gathered if gathered is not None else weight[:, outlier_cols].contiguous()
        weight_cols = int8_vectorwise_dequant(columns, SCB).to(A.dtype)
        out = out.addmm(rows[:, outlier_cols], weight_cols.t())
    return out.reshape(*A.shape[:-1], weight.shape[0])


_INT8_LINEAR = define_op(
    "int8_linear", _int8_linear_reference, fake=_int8_linear_fake, cases=_cases, check=_check_int8_linear
)
# Other devices run the reference, whose steps each dispatch on their own.
register_kernel("int8_linear", "cpu", _int8_linear_cpu, label="int8 CPU kernels in sequence")


def _setup_context(ctx, inputs, output):
    A, weight, SCB, bias, threshold = inputs
    ctx.save_for_backward(weight, SCB)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    weight, SCB = ctx.saved_tensors
    grad_A = grad @ int8_vectorwise_dequant(weight, SCB).to(grad.dtype) if ctx.needs_input_grad[0] else None
    grad_bias = None
    if ctx.needs_input_grad[3]:
        grad_bias = grad.reshape(-1, weight.shape[0]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_A, None, None, grad_bias, None


_INT8_LINEAR.custom_op.register_autograd(_backward, setup_context=_setup_context)


def int8_linear(
    A: torch.Tensor, weight: torch.Tensor, SCB: torch.Tensor, bias: torch.Tensor | None = None, threshold: float = 0.0
) -> torch.Tensor:
    """LLM.int8() ``A @ W.T + bias`` for an int8 ``weight`` (out x in) with row scales
    ``SCB``; input columns holding a value of magnitude >= ``threshold`` (when > 0) are
    multiplied in ``A``'s dtype. Differentiable in ``A`` and ``bias``."""
    return _INT8_LINEAR(A, weight, SCB, bias, float(check_non_negative_number("threshold", threshold)))
