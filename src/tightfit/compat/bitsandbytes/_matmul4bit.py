"""bitsandbytes' top-level ``bnb.matmul_4bit``: tightfit's
:func:`tightfit.quant.functional.matmul_4bit`, plus the one layout bitsandbytes still takes
with a ``DeprecationWarning``: a weight quantized in (in x out) orientation, told apart by
``A``'s last dimension matching the state's first and not its second (a square weight is
(out x in), as there). That path decodes the weight and keeps it for the backward."""

from __future__ import annotations

import warnings

import torch

from tightfit._validate import check_choice
from tightfit.compat.bitsandbytes._common import check_optional_tensor, check_out
from tightfit.ops._arg_checks import FLOAT_DTYPES
from tightfit.quant import functional as QF
from tightfit.quant.state import QuantState

__all__ = ["matmul_4bit"]


def _in_by_out(A: object, state: object) -> bool:
    """Whether ``state`` describes a 4-bit (in x out) weight for ``A`` (anything else goes to
    tightfit's matmul_4bit, which checks it)."""
    return (
        isinstance(A, torch.Tensor)
        and A.dim() >= 1
        and isinstance(state, QuantState)
        and state.quant_type is not None
        and state.shape is not None
        and len(state.shape) == 2
        and A.shape[-1] == state.shape[0] != state.shape[1]
    )


def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    quant_state: QuantState,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A @ W.T + bias`` for packed 4-bit codes ``B`` of a weight ``W`` (out x in); for one
    quantized (in x out), ``A @ W + bias`` with bitsandbytes' DeprecationWarning."""
    if not _in_by_out(A, quant_state):
        return QF.matmul_4bit(A, B, quant_state, out, bias)
    check_choice("A.dtype", A.dtype, FLOAT_DTYPES)
    check_optional_tensor("bias", bias)
    features = quant_state.shape[1]
    if bias is not None and tuple(bias.shape) != (features,):
        raise ValueError(f"bias must have shape ({features},) for quant_state.shape {tuple(quant_state.shape)}")
    check_out("out", out, (*A.shape[:-1], features), A.dtype, A)
    warnings.warn(
        f"matmul_4bit: the weight was quantized in (in x out) orientation (quant_state.shape="
        f"{list(quant_state.shape)}); quantize it as (out_features, in_features). bitsandbytes will refuse it.",
        DeprecationWarning,
        stacklevel=2,
    )
    weight = QF.dequantize_4bit(B.reshape(-1, 1), quant_state).to(A.dtype)
    result = torch.nn.functional.linear(A, weight.t(), None if bias is None else bias.to(A.dtype))
    return result if out is None else out.copy_(result)
