"""bitsandbytes' top-level ``bnb.matmul_4bit``: tightfit's
:func:`tightfit.quant.functional.matmul_4bit`, plus the one layout bitsandbytes still takes
with a ``DeprecationWarning``: a weight quantized in (in x out) orientation, told apart by
``A``'s last dimension matching the state's first and not its second (a square weight is
(out x in), as there). That path decodes the weight and keeps it for the backward."""

from __future__ import annotations

import warnings

import torch

from tightfit._validate import check_choice, check_type
from tightfit.compat.bitsandbytes._common import check_bias, check_out
from tightfit.ops._arg_checks import FLOAT_DTYPES, check_packed
from tightfit.quant import functional as QF
from tightfit.quant.state import QuantState

__all__ = ["matmul_4bit"]


def _weight_state(state: object) -> bool:
    """Whether ``state`` is a 4-bit state of a 2-D weight (anything else goes to tightfit's
    matmul_4bit, which refuses it)."""
    return (
        isinstance(state, QuantState)
        and state.quant_type is not None
        and state.shape is not None
        and len(state.shape) == 2
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
    check_type("A", A, torch.Tensor)
    if A.dim() < 1:
        raise ValueError("A must have at least one dimension (rows x in_features), got a scalar")
    if not _weight_state(quant_state):
        return QF.matmul_4bit(A, B, quant_state, out, bias)
    rows, columns = quant_state.shape  # (out x in); (in x out) where A's last dimension is ``rows``
    check_packed("B", B, rows * columns, [rows, columns])
    if not A.shape[-1] == rows != columns:
        if A.shape[-1] != columns:
            raise ValueError(f"A has shape {tuple(A.shape)}; its last dimension must be in_features, {columns}")
        check_bias(bias, rows, A)
        return QF.matmul_4bit(A, B, quant_state, out, bias)
    check_choice("A.dtype", A.dtype, FLOAT_DTYPES)
    check_bias(bias, columns, A)  # (in x out): ``columns`` are the out features
    check_out("out", out, (*A.shape[:-1], columns), A.dtype, A)
    warnings.warn(
        f"matmul_4bit: the weight was quantized in (in x out) orientation (quant_state.shape="
        f"{list(quant_state.shape)}); quantize it as (out_features, in_features). bitsandbytes will refuse it.",
        DeprecationWarning,
        stacklevel=2,
    )
    weight = QF.dequantize_4bit(B.reshape(-1, 1), quant_state).to(A.dtype)
    result = torch.nn.functional.linear(A, weight.t(), None if bias is None else bias.to(A.dtype))
    return result if out is None else out.copy_(result)
