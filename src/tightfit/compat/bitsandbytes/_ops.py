"""bitsandbytes' op schemas on tightfit's ops: the public op surface bitsandbytes' users and
vendors' backends call (``torch.ops.bitsandbytes.gemv_4bit(A, B, shapeB, absmax, code,
blocksize)`` and the rest), defined in the namespace ``tightfit_bitsandbytes``, with the
same names, argument orders, defaults and ``.out`` overloads. Where bitsandbytes itself is
not installed they are defined under ``bitsandbytes`` too, so code that calls
``torch.ops.bitsandbytes.*`` runs unchanged; where it is, its own ops keep that namespace
and nothing clashes.

Each op is CompositeImplicitAutograd: it runs tightfit's ops (checked, dispatched on the
tensor's device, fake kernels for tracing), so autograd, ``torch.compile`` and
``torch.library.opcheck`` see through it, and a backend's kernels for tightfit's ops serve
these too. ``gemv_4bit`` reads its 4-bit table's values to name the format tightfit's op
takes, so it is a kernel of its own with a fake kernel (inference only, as bitsandbytes'). Not offered: bitsandbytes' ``int8_double_quant``, ``int8_mixed_scaled_mm`` and
its optimizer ops, whose extra arguments (``unorm_vec``, ``gnorm_scale``, ``skip_zeros``)
tightfit's optimizers do not take (docs/migrating.md).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tightfit.compat.bitsandbytes._common import check_out
from tightfit.ops.codes import code_4bit

__all__ = ["NAMESPACE", "defined_namespaces"]

#: The namespace tightfit always defines bitsandbytes' schemas in.
NAMESPACE = "tightfit_bitsandbytes"
_INT8_SCALE = 1 / 127  # bitsandbytes' int8 dequantization scale
_NESTED_BLOCKSIZE = 256  # bitsandbytes' blocksize for double-quantized scales

_tightfit = torch.ops.tightfit


def _int8_linear_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return _tightfit.int8_linear_matmul(A, B)


def _int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    rows, stats, columns = _tightfit.int8_vectorwise_quant(A, threshold)
    return rows, stats, columns if threshold > 0.0 else None


def _int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    return A * stats.view(-1, 1) * _INT8_SCALE


def _int8_mm_dequant(
    A: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, dtype: Any = None, bias: Any = None
) -> torch.Tensor:
    return _tightfit.int8_mm_dequant(A, row_stats, col_stats, torch.float16 if dtype is None else dtype, bias)


def _int8_scaled_mm(
    A: torch.Tensor,
    B: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    bias: Any = None,
    dtype: Any = None,
) -> torch.Tensor:
    return _int8_mm_dequant(_tightfit.int8_linear_matmul(A, B), row_stats, col_stats, dtype, bias)


def _quantize_blockwise(A: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _tightfit.quantize_blockwise(A, code, blocksize)


def _dequantize_blockwise(
    A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, dtype: torch.dtype
) -> torch.Tensor:
    return _tightfit.dequantize_blockwise(A, absmax, code, blocksize, dtype)


def _quantize_4bit(
    A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    return _tightfit.quantize_4bit(A, blocksize, quant_type, quant_storage)


def _dequantize_4bit(
    A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    return _tightfit.dequantize_4bit(A, absmax, blocksize, quant_type, list(shape), dtype)


def _quant_type_of(code: torch.Tensor) -> str:
    """The 4-bit format whose table ``code`` is (bitsandbytes passes the table, tightfit its name)."""
    table = code.detach().to("cpu", torch.float32).reshape(-1)
    for name in ("nf4", "fp4"):
        if table.shape == (16,) and torch.equal(table, code_4bit(name)):
            return name
    raise ValueError(
        f"code must be the NF4 or FP4 table (16 float32 values, as bitsandbytes' quant states hold them), "
        f"got {tuple(code.shape)} {code.dtype}"
    )


def _gemv_4bit(
    A: torch.Tensor, B: torch.Tensor, shapeB: Sequence[int], absmax: torch.Tensor, code: torch.Tensor, blocksize: int
) -> torch.Tensor:
    return _tightfit.gemv_4bit(A, B, list(shapeB), absmax, blocksize, _quant_type_of(code))


def _gemm_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    shapeB: Sequence[int],
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    bias: Any = None,
    absmax_8bit: Any = None,
    absmax_code: Any = None,
    absmax_offset: Any = None,
) -> torch.Tensor:
    """``A @ decode(B).T + bias``; with ``absmax_8bit`` the scales are double-quantized:
    ``absmax`` then holds their own scales, decoded with ``absmax_code`` plus ``absmax_offset``."""
    if absmax_8bit is not None:
        if absmax_code is None or absmax_offset is None:
            raise ValueError("absmax_8bit (double-quantized scales) needs absmax_code and absmax_offset")
        absmax = _tightfit.dequantize_blockwise(
            absmax_8bit, absmax, absmax_code, _NESTED_BLOCKSIZE, torch.float32
        ) + absmax_offset.to(torch.float32)
    weight = _tightfit.dequantize_4bit(B, absmax, blocksize, quant_type, list(shapeB), A.dtype)
    return torch.nn.functional.linear(A, weight, bias)


def _into(compute: Callable[..., torch.Tensor]) -> Callable[..., None]:
    """The ``.out`` overload of ``compute``: its result written into ``out``."""

    def written(*args: Any) -> None:
        *inputs, out = args
        result = compute(*inputs)
        check_out("out", out, tuple(result.shape), result.dtype, result)
        out.copy_(result)

    return written


#: name -> (bitsandbytes' schema, tightfit's implementation), bitsandbytes 0.50's schemas.
_OPS: dict[str, tuple[str, Callable[..., Any]]] = {
    "int8_linear_matmul": ("(Tensor A, Tensor B) -> Tensor", _int8_linear_matmul),
    "int8_linear_matmul.out": ("(Tensor A, Tensor B, Tensor(a!) out) -> ()", _into(_int8_linear_matmul)),
    "int8_vectorwise_quant": (
        "(Tensor A, float threshold=0.0) -> (Tensor, Tensor, Tensor?)",
        _int8_vectorwise_quant,
    ),
    "int8_vectorwise_dequant": ("(Tensor A, Tensor stats) -> Tensor", _int8_vectorwise_dequant),
    "int8_mm_dequant": (
        "(Tensor A, Tensor row_stats, Tensor col_stats, ScalarType? dtype=None, Tensor? bias=None) -> Tensor",
        _int8_mm_dequant,
    ),
    "int8_scaled_mm": (
        "(Tensor A, Tensor B, Tensor row_stats, Tensor col_stats, Tensor? bias=None, ScalarType? dtype=None) -> Tensor",
        _int8_scaled_mm,
    ),
    "quantize_blockwise": ("(Tensor A, Tensor code, int blocksize) -> (Tensor, Tensor)", _quantize_blockwise),
    "dequantize_blockwise": (
        "(Tensor A, Tensor absmax, Tensor code, int blocksize, ScalarType dtype) -> Tensor",
        _dequantize_blockwise,
    ),
    "dequantize_blockwise.out": (
        "(Tensor A, Tensor absmax, Tensor code, int blocksize, ScalarType dtype, Tensor(a!) out) -> ()",
        _into(_dequantize_blockwise),
    ),
    "quantize_4bit": (
        "(Tensor A, int blocksize, str quant_type, ScalarType quant_storage) -> (Tensor, Tensor)",
        _quantize_4bit,
    ),
    "dequantize_4bit": (
        "(Tensor A, Tensor absmax, int blocksize, str quant_type, int[] shape, ScalarType dtype) -> Tensor",
        _dequantize_4bit,
    ),
    "dequantize_4bit.out": (
        "(Tensor A, Tensor absmax, int blocksize, str quant_type, int[] shape, ScalarType dtype, Tensor(a!) out) -> ()",
        _into(_dequantize_4bit),
    ),
    "gemv_4bit": (
        "(Tensor A, Tensor B, int[] shapeB, Tensor absmax, Tensor code, int blocksize) -> Tensor",
        _gemv_4bit,
    ),
    "gemv_4bit.out": (
        "(Tensor A, Tensor B, int[] shapeB, Tensor absmax, Tensor code, int blocksize, Tensor(a!) out) -> ()",
        _into(_gemv_4bit),
    ),
    "gemm_4bit": (
        "(Tensor A, Tensor B, int[] shapeB, Tensor absmax, int blocksize, str quant_type, Tensor? bias=None, "
        "Tensor? absmax_8bit=None, Tensor? absmax_code=None, Tensor? absmax_offset=None) -> Tensor",
        _gemm_4bit,
    ),
}

_LIBRARIES: dict[str, torch.library.Library] = {}


def _gemv_4bit_shape(
    A: torch.Tensor, B: torch.Tensor, shapeB: Sequence[int], absmax: torch.Tensor, code: torch.Tensor, blocksize: int
) -> torch.Tensor:
    return A.new_empty((*A.shape[:-1], shapeB[0]))


#: Ops that read a tensor's values to choose their computation (gemv_4bit: the 4-bit format
#: from its table): kernels of their own with a fake kernel for tracing, not composites.
_OPAQUE = {"gemv_4bit": _gemv_4bit_shape, "gemv_4bit.out": lambda *args: None}


def _define(namespace: str) -> None:
    library = torch.library.Library(namespace, "DEF")
    for name, (schema, implementation) in _OPS.items():
        library.define(f"{name}{schema}")
        if name in _OPAQUE:
            library.impl(name, implementation, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{namespace}::{name}", _OPAQUE[name], lib=library)
        else:
            library.impl(name, implementation, "CompositeImplicitAutograd")
    _LIBRARIES[namespace] = library


def _bitsandbytes_installed() -> bool:
    try:
        return importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):  # a finder refusing it, or a half-imported module
        return False


def defined_namespaces() -> tuple[str, ...]:
    """The namespaces bitsandbytes' schemas are defined in: ``tightfit_bitsandbytes``, and
    ``bitsandbytes`` where bitsandbytes is not installed. Defined at the first call (the
    compat package's import makes it)."""
    if not _LIBRARIES:
        _define(NAMESPACE)
        if not _bitsandbytes_installed():
            _define("bitsandbytes")
    return tuple(_LIBRARIES)
