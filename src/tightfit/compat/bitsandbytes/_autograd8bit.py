"""bitsandbytes' top-level LLM.int8() product, ``bnb.matmul`` and its ``MatmulLtState``, on
tightfit's ``int8_linear`` op (one op with a backward, dispatched on the tensor's device).

Differences from bitsandbytes, on purpose: the input is quantized in its own dtype
(bitsandbytes casts it to float16 first, which overflows past 65504), and the product is
the int8 one in training too (bitsandbytes' CPU path multiplies by the dequantized weight
while training and ignores ``threshold`` there). ``out=``, which bitsandbytes ignores,
receives the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tightfit import ops
from tightfit._validate import check_non_negative_number, check_type
from tightfit.compat.bitsandbytes._common import check_out
from tightfit.ops._arg_checks import FLOAT_DTYPES

__all__ = ["MatmulLtState", "matmul"]


@dataclass
class MatmulLtState:
    """What a ``Linear8bitLt`` keeps between calls, as bitsandbytes names it: the int8
    weight ``CB`` (out x in), its row scales ``SCB`` (float32), the outlier ``threshold``
    and whether the weight is kept in float (``has_fp16_weights``, quantized per call)."""

    CB: torch.Tensor | None = None
    SCB: torch.Tensor | None = None
    threshold: float = 0.0
    has_fp16_weights: bool = True
    is_training: bool = True
    idx: torch.Tensor | None = None
    use_pool: bool = False

    def reset_grads(self) -> None:
        """Forget the quantized weight (bitsandbytes' name for it)."""
        self.CB = None
        self.SCB = None


class _WeightGradient(torch.autograd.Function):
    """Passes the product through unchanged and gives a float weight ``B`` the gradient of
    ``A @ B.T`` (``grad.T @ A``), as bitsandbytes does for ``has_fp16_weights=True``; the
    input's and the bias' gradients come from ``int8_linear``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(A)
        ctx.weight_dtype = B.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (A,) = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_B = rows.t() @ A.reshape(-1, A.shape[-1]).to(rows.dtype)
        return grad, None, grad_B.to(ctx.weight_dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CB, SCB)`` of a float weight, quantized from its float16 copy as bitsandbytes
    does, so codes and scales are bit-equal to its own."""
    half = weight.detach().contiguous().to(torch.float16)
    if half.numel() and not bool(torch.isfinite(half).all()):
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} has NaN, inf or values past float16's range (65504); "
            "int8 weights are quantized from float16, as bitsandbytes does"
        )
    CB, SCB, _ = ops.int8_vectorwise_quant(half)
    return CB, SCB


def _check_state_weight(state: MatmulLtState, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    CB, SCB = state.CB, state.SCB
    check_type("state.CB", CB, torch.Tensor)
    check_type("state.SCB", SCB, torch.Tensor)
    if CB.dtype != torch.int8 or CB.shape != B.shape:
        raise ValueError(f"state.CB must be int8 of B's shape {tuple(B.shape)}, got {CB.dtype} {tuple(CB.shape)}")
    return CB, SCB


def _transposed_view_of(B: torch.Tensor, CB: object) -> bool:
    """Whether ``B`` is ``CB.t()``: the same bytes read transposed, how bitsandbytes' callers
    may pass the weight whose codes ``state.CB`` holds. A transposed copy is not accepted:
    its layout could not be told from an (out x in) weight's when the weight is square."""
    return (
        isinstance(CB, torch.Tensor)
        and CB.dim() == 2
        and tuple(B.shape) == tuple(CB.shape)[::-1]
        and B.stride() == CB.stride()[::-1]
        and B.device == CB.device
        and B.dtype == CB.dtype
        and B.data_ptr() == CB.data_ptr()
    )


def matmul(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    state: MatmulLtState | None = None,
    threshold: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LLM.int8() ``A @ B.T + bias`` for a weight ``B`` (out x in): int8 (its scales in
    ``state.SCB`` or ``B.SCB``; ``B = state.CB.t()``, a view, means ``state.CB`` as in
    bitsandbytes), or float, quantized into ``state.CB``/``state.SCB`` (once,
    or every call with ``state.has_fp16_weights``; then ``B`` gets a gradient). Input
    columns holding a value of magnitude >= ``threshold`` (> 0; it is stored in
    ``state``) are multiplied in ``A``'s dtype. Differentiable in ``A`` and ``bias``."""
    check_type("A", A, torch.Tensor)
    check_type("B", B, torch.Tensor)
    if state is None:
        state = MatmulLtState()
    check_type("state", state, MatmulLtState)
    if check_non_negative_number("threshold", threshold) > 0.0:
        state.threshold = threshold
    if B.dim() != 2:
        raise ValueError(f"B must be a 2-D weight (out x in), got shape {tuple(B.shape)}")
    transposed = B.dtype == torch.int8 and _transposed_view_of(B, state.CB)
    if out is not None:  # checked before any work, so a refused call writes nothing
        check_out("out", out, (*A.shape[:-1], B.shape[1 if transposed else 0]), A.dtype, A)
    weight_grad = False
    if B.dtype == torch.int8:
        SCB = state.SCB if state.SCB is not None else getattr(B, "SCB", None)
        if SCB is None:
            raise ValueError("B is int8 but neither state.SCB nor B.SCB holds its row scales")
        CB = (state.CB if transposed else B).detach()  # a plain tensor for the op, not the parameter subclass
        if A.dim() >= 1 and CB.shape[1] != A.shape[-1]:
            raise ValueError(
                f"B must be the int8 weight (out x {A.shape[-1]}) for A {tuple(A.shape)}, or state.CB.t() "
                f"(a view of it), got {tuple(B.shape)}"
            )
    elif B.dtype not in FLOAT_DTYPES:
        raise TypeError(f"B has dtype {B.dtype}; accepted: int8, float32, float16, bfloat16")
    elif state.has_fp16_weights or state.CB is None:
        state.CB, state.SCB = CB, SCB = quantize_weight(B)
        weight_grad = B.requires_grad and torch.is_grad_enabled()
    else:
        CB, SCB = _check_state_weight(state, B)
    result = ops.int8_linear(A, CB, SCB, bias, check_non_negative_number("state.threshold", state.threshold))
    if weight_grad:
        result = _WeightGradient.apply(result, A.detach(), B)
    return result if out is None else out.copy_(result)
