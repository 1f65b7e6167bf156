"""The ``bitsandbytes.functional`` API on tightfit's ops: same names and signatures, so
code written against bitsandbytes ports by changing one import.

``nested=True`` / ``compress_statistics=True`` double-quantize the absmax: its mean is
subtracted and the rest quantized to 8 bits in blocks of 256 (4-bit) or of
``blocksize`` (8-bit), as bitsandbytes does.
"""

from __future__ import annotations

from typing import Any

import torch

from tightfit import ops
from tightfit._validate import check_choice, check_type
from tightfit.ops._direct import with_bias
from tightfit.quant import _tiled
from tightfit.quant.state import QuantState

__all__ = [
    "QuantState",
    "dequantize_4bit",
    "dequantize_blockwise",
    "dequantize_fp4",
    "dequantize_nf4",
    "gemv_4bit",
    "int8_linear_matmul",
    "int8_mm_dequant",
    "int8_vectorwise_dequant",
    "int8_vectorwise_quant",
    "matmul_4bit",
    "quantize_4bit",
    "quantize_blockwise",
    "quantize_fp4",
    "quantize_nf4",
]

NESTED_BLOCKSIZE_4BIT = 256


def _copy_into(name: str, target: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """The ``out=`` / ``absmax=`` convention: write into a caller's tensor when given."""
    if target is None:
        return value
    check_type(name, target, torch.Tensor)
    if target.shape != value.shape or target.dtype != value.dtype:
        raise ValueError(
            f"{name} must have shape {tuple(value.shape)} and dtype {value.dtype}, got {tuple(target.shape)} {target.dtype}"
        )
    return target.copy_(value)


def _nest(absmax: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor, QuantState]:
    offset = absmax.mean()
    codes, state2 = quantize_blockwise(absmax - offset, blocksize=blocksize)
    return codes, offset, state2


def _stored_scales(state: QuantState) -> tuple[Any, ...]:
    """The block scales as the few-token ops take them, as stored: (absmax, absmax2, code2,
    nested_blocksize, offset), the last four unset where the scales are not double-quantized."""
    if not state.nested:
        return state.absmax, None, None, 256, None
    return state.absmax, state.state2.absmax, state.state2.code, state.state2.blocksize, state.offset


#: How a blockwise layer multiplies: in float, or with int8 activations (``matmul_4bit(compute=...)``,
#: ``Linear8bit.from_linear(compute=...)``).
COMPUTE_CHOICES = ("float", "int8")


def _few_tokens(A: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the few-token kernels, which read the codes in the product, run for ``A``:
    at most ``FEW_TOKENS`` rows, no gradient recorded (training runs the tiled GEMMs,
    whose forward and backward match ``F.linear`` on the decoded weight bit for bit)."""
    recording = torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad))
    return not recording and A.dim() > 0 and A.numel() <= ops.FEW_TOKENS * A.shape[-1]


def _absmax_of(state: QuantState) -> torch.Tensor:
    if not state.nested:
        return state.absmax
    return dequantize_blockwise(state.absmax, state.state2) + state.offset


def quantize_blockwise(
    A: torch.Tensor,
    code: torch.Tensor | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> tuple[torch.Tensor, QuantState]:
    """8-bit blockwise quantization; returns (uint8 codes, QuantState)."""
    check_type("nested", nested, bool)
    q, scales = ops.quantize_blockwise(A, code, blocksize)
    code = ops.dynamic_map().to(A.device) if code is None else code.clone()
    if nested:
        nested_codes, offset, state2 = _nest(scales, blocksize)
        state = QuantState(
            absmax=nested_codes, code=code, blocksize=blocksize, dtype=A.dtype, offset=offset, state2=state2
        )
    else:
        state = QuantState(absmax=_copy_into("absmax", absmax, scales), code=code, blocksize=blocksize, dtype=A.dtype)
    return _copy_into("out", out, q), state


def dequantize_blockwise(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    code: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> torch.Tensor:
    """Decode 8-bit codes with ``quant_state`` (or with ``absmax``, ``code`` and ``blocksize``)."""
    if quant_state is None:
        if absmax is None:
            raise ValueError("dequantize_blockwise needs quant_state, or absmax (with code and blocksize)")
        quant_state = QuantState(
            absmax=absmax,
            code=ops.dynamic_map().to(absmax.device) if code is None else code,
            blocksize=blocksize,
            dtype=torch.float32,
        )
    check_type("quant_state", quant_state, QuantState)
    result = ops.dequantize_blockwise(
        A, _absmax_of(quant_state).float(), quant_state.code, quant_state.blocksize, quant_state.dtype
    )
    return _copy_into("out", out, result)


def quantize_4bit(
    A: torch.Tensor,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    compress_statistics: bool = False,
    quant_type: str = "fp4",
    quant_storage: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, QuantState]:
    """4-bit (NF4 / FP4) blockwise quantization; returns (packed codes, QuantState)."""
    check_type("compress_statistics", compress_statistics, bool)
    blocksize = 64 if blocksize is None else blocksize
    packed, scales = ops.quantize_4bit(A, blocksize, quant_type, quant_storage)
    common = dict(
        shape=A.shape,
        dtype=A.dtype,
        blocksize=blocksize,
        code=ops.code_4bit(quant_type).to(A.device),
        quant_type=quant_type,
    )
    if compress_statistics:
        nested_codes, offset, state2 = _nest(scales, NESTED_BLOCKSIZE_4BIT)
        state = QuantState(absmax=nested_codes, offset=offset, state2=state2, **common)
    else:
        state = QuantState(absmax=_copy_into("absmax", absmax, scales), **common)
    return _copy_into("out", out, packed), state


def dequantize_4bit(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    quant_type: str = "fp4",
) -> torch.Tensor:
    """Decode packed 4-bit codes with ``quant_state`` (or with ``absmax`` and ``out``'s shape and dtype)."""
    if quant_state is None:
        if absmax is None or out is None:
            raise ValueError("dequantize_4bit needs quant_state, or both absmax and out")
        quant_state = QuantState(
            absmax=absmax,
            code=ops.code_4bit(quant_type),
            shape=out.shape,
            dtype=out.dtype,
            blocksize=64 if blocksize is None else blocksize,
            quant_type=quant_type,
        )
    check_type("quant_state", quant_state, QuantState)
    if quant_state.quant_type is None or quant_state.shape is None:
        raise ValueError("quant_state is not a 4-bit state (quant_type and shape are needed)")
    result = ops.dequantize_4bit(
        A,
        _absmax_of(quant_state).float(),
        quant_state.blocksize,
        quant_state.quant_type,
        list(quant_state.shape),
        quant_state.dtype,
    )
    return _copy_into("out", out, result)


def quantize_nf4(
    A: torch.Tensor,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    compress_statistics: bool = False,
    quant_storage: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, QuantState]:
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "nf4", quant_storage)


def quantize_fp4(
    A: torch.Tensor,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    compress_statistics: bool = False,
    quant_storage: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, QuantState]:
    return quantize_4bit(A, absmax, out, blocksize, compress_statistics, "fp4", quant_storage)


def dequantize_nf4(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
) -> torch.Tensor:
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "nf4")


def dequantize_fp4(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
) -> torch.Tensor:
    return dequantize_4bit(A, quant_state, absmax, out, blocksize, "fp4")


def int8_vectorwise_quant(
    A: torch.Tensor, threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """LLM.int8() row-wise quantization: (int8 values, float32 row absmax, outlier columns).
    The columns are None when ``threshold`` is 0 and empty when no value reaches it."""
    return ops.int8_vectorwise_quant(A, threshold)


def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """float32 ``A * stats / 127`` per row, the inverse of :func:`int8_vectorwise_quant`."""
    return ops.int8_vectorwise_dequant(A, stats)


def int8_linear_matmul(
    A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Exact ``A @ B.T`` of int8 matrices, as int32 (the only ``dtype`` bitsandbytes accepts)."""
    if dtype != torch.int32:
        raise ValueError(f"dtype={dtype} is not accepted; int8_linear_matmul returns torch.int32")
    return _copy_into("out", out, ops.int8_linear_matmul(A, B))


def int8_mm_dequant(
    A: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Scale an int32 product back to floats (+ ``bias``). ``dtype`` defaults to ``out``'s,
    else float16 as in bitsandbytes, whose signature this keeps (``dtype`` is an addition)."""
    if dtype is None:
        dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float16
    return _copy_into("out", out, ops.int8_mm_dequant(A, row_stats, col_stats, dtype, bias))


def _check_4bit_weight_state(state: object) -> QuantState:
    check_type("quant_state", state, QuantState)
    if state.quant_type is None or state.shape is None or len(state.shape) != 2:
        raise ValueError("quant_state must describe a 4-bit weight of shape (out_features, in_features)")
    return state


def gemv_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    transposed_A: bool = False,
    transposed_B: bool = False,
    state: QuantState | None = None,
) -> torch.Tensor:
    """``A @ dequantize(B).T`` without materializing the weight (bitsandbytes' signature;
    the transposed flags are accepted for compatibility and must be False)."""
    if transposed_A or transposed_B:
        raise ValueError("transposed_A and transposed_B are not supported; pass A and B as stored")
    state = _check_4bit_weight_state(state)
    absmax, *nested = _stored_scales(state)
    result = ops.gemv_4bit(A, B, list(state.shape), absmax, state.blocksize, state.quant_type, *nested)
    return _copy_into("out", out, result)


def _decode(B: torch.Tensor, state: QuantState) -> torch.Tensor:
    """The weight held by codes ``B`` and ``state``: 4-bit when the state names a quant_type, else 8-bit blockwise."""
    return dequantize_4bit(B, state) if state.quant_type else dequantize_blockwise(B, state)


def _linear(A: torch.Tensor, B: torch.Tensor, state: QuantState, bias: torch.Tensor | None) -> torch.Tensor:
    """``A @ decode(B).T + bias`` in ``A``'s dtype, decoding one tile of weight rows at a
    time (``_tiled``): what it holds above its output is a tile, not the decoded weight."""
    grid = _tiled.layout(B, state, A.shape[-1] if A.dim() else -1, A.dtype.itemsize)
    if grid is None:  # codes or a state that tiling cannot slice: decoded whole, the ops refuse them
        weight = _decode(B, state).to(A.dtype)
        return torch.nn.functional.linear(A, weight, None if bias is None else bias.to(A.dtype))
    return _tiled.linear(A, B, state, bias, grid)


class _LinearDecodedTwice(torch.autograd.Function):
    """``A @ decode(B).T + bias`` that saves the codes, not the decoded weight, for the
    backward and decodes them again there, as bitsandbytes' ``MatMul4Bit`` does: in a
    QLoRA fine-tune every layer's full-precision weight would otherwise stay alive from
    its forward to its backward. Both decode a tile of rows at a time. Gradients for
    ``A`` and ``bias``; the weight is frozen."""

    @staticmethod
    def forward(
        ctx: Any, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, state: QuantState
    ) -> torch.Tensor:
        ctx.save_for_backward(B)
        ctx.state = state
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.in_features = A.shape[-1]
        return _linear(A, B, state, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        (B,) = ctx.saved_tensors
        grad_A = grad_bias = None
        if ctx.needs_input_grad[0]:
            # The tiles are sliced from other views of the codes than the forward's:
            # torch.compile's common-subexpression pass would otherwise merge the two
            # decodes and keep the decoded tiles alive from the forward to the backward.
            grid = _tiled.layout(B, ctx.state, ctx.in_features, grad.dtype.itemsize)
            if grid is None:
                weight = _decode(B.reshape(-1), ctx.state).view(grad.shape[-1], ctx.in_features)
                grad_A = grad.matmul(weight.to(grad.dtype))
            else:
                grad_A = _tiled.grad_input(grad, B, ctx.state, grid)
        if ctx.needs_input_grad[2]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_A, None, grad_bias, None


def _decoded_linear(
    A: torch.Tensor, B: torch.Tensor, state: QuantState, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``A @ decode(B).T + bias`` in ``A``'s dtype for 4-bit or 8-bit blockwise codes ``B``
    (the quantized layers' forward), a tile of decoded weight rows at a time. Without
    gradients each tile is dropped after its product; with them only the codes wait
    for the backward. Up to ``FEW_TOKENS`` rows, 8-bit codes go through the few-token kernel."""
    if state.quant_type is None and _few_tokens(A, bias) and B.dim() == 2:
        absmax, *nested = _stored_scales(state)
        return with_bias(ops.gemv_blockwise(A, B, absmax, state.code, state.blocksize, *nested), bias, A.dtype)
    if torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad)):
        return _LinearDecodedTwice.apply(A, B, bias, state)
    return _linear(A, B, state, bias)


def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    quant_state: QuantState,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    compute: str = "float",
) -> torch.Tensor:
    """``A @ dequantize(B).T + bias`` in ``A``'s dtype. Up to ``FEW_TOKENS`` rows without
    gradients (decoding) run the fused kernel, which never holds the decoded weight; more rows decode the weight
    a tile of rows at a time for torch's matmul; for the backward they keep the codes,
    not the weight. ``compute="int8"`` (not in bitsandbytes) quantizes ``A`` to int8 per
    block of 32 and multiplies in integers at every row count (:func:`tightfit.ops.gemv_4bit_int8`)."""
    state = _check_4bit_weight_state(quant_state)
    check_type("A", A, torch.Tensor)
    check_choice("compute", compute, COMPUTE_CHOICES)
    if compute == "int8" or _few_tokens(A, bias):
        absmax, *nested = _stored_scales(state)
        gemv = ops.gemv_4bit_int8 if compute == "int8" else ops.gemv_4bit
        result = gemv(A, B, list(state.shape), absmax, state.blocksize, state.quant_type, *nested)
        result = with_bias(result, bias, A.dtype)
    else:
        result = _decoded_linear(A, B, state, bias)
    return _copy_into("out", out, result)
