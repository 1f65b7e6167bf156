"""``bitsandbytes.functional`` on tightfit: ``import tightfit.compat.bitsandbytes.functional
as F`` in place of ``import bitsandbytes.functional as F``.

The quantization functions are :mod:`tightfit.quant.functional`'s (same names, argument
names and defaults); here they also check an ``out=`` / ``absmax=`` tensor (shape, dtype
and device) before computing, where bitsandbytes would ``copy_`` into anything. The
code-map constructors build bitsandbytes' maps the way it builds them, so they are
bit-equal to its own on the CPU; ``create_normal_map`` uses torch's inverse normal CDF,
where bitsandbytes needs scipy. ``gemm_4bit`` and ``int8_scaled_mm`` are bitsandbytes'
ops (``torch.ops.bitsandbytes.*``) as functions.
"""

from __future__ import annotations

import itertools
import math

import torch

from tightfit import ops
from tightfit._validate import check_choice, check_same_device, check_type
from tightfit.compat.bitsandbytes._common import check_bias, check_out, fixed_argument
from tightfit.ops._arg_checks import block_count, check_packed, packed_bytes
from tightfit.ops.codes import QUANT_TYPES_4BIT, dynamic_values
from tightfit.quant import functional as QF
from tightfit.quant.functional import QuantState, int8_vectorwise_dequant, int8_vectorwise_quant

__all__ = [
    "QuantState",
    "create_dynamic_map",
    "create_fp8_map",
    "create_linear_map",
    "create_normal_map",
    "dequantize_4bit",
    "dequantize_blockwise",
    "dequantize_fp4",
    "dequantize_nf4",
    "gemm_4bit",
    "gemv_4bit",
    "get_4bit_type",
    "has_avx512bf16",
    "int8_linear_matmul",
    "int8_mm_dequant",
    "int8_scaled_mm",
    "int8_vectorwise_dequant",
    "int8_vectorwise_quant",
    "quantize_4bit",
    "quantize_blockwise",
    "quantize_fp4",
    "quantize_nf4",
]


def _tensor(name: str, value: object) -> torch.Tensor:
    check_type(name, value, torch.Tensor)
    return value


def quantize_blockwise(
    A: torch.Tensor,
    code: torch.Tensor | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> tuple[torch.Tensor, QuantState]:
    """8-bit blockwise quantization: (uint8 codes shaped like ``A``, QuantState)."""
    A = _tensor("A", A)
    check_out("out", out, tuple(A.shape), torch.uint8, A)
    if isinstance(blocksize, int) and blocksize > 0:
        check_out("absmax", absmax, (block_count(A.numel(), blocksize),), torch.float32, A)
    return QF.quantize_blockwise(A, code, absmax, out, blocksize, nested)


def dequantize_blockwise(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    code: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int = 4096,
    nested: bool = False,
) -> torch.Tensor:
    """Decode 8-bit codes with ``quant_state`` (or ``absmax``, ``code``, ``blocksize``), in its
    dtype. ``absmax`` may have any shape holding one scale a block, in order (an 8-bit
    AdEMAMix's ``(2, blocks)``), as bitsandbytes reads it."""
    A = _tensor("A", A)
    dtype = quant_state.dtype if isinstance(quant_state, QuantState) else torch.float32
    check_out("out", out, tuple(A.shape), dtype, A)
    if isinstance(absmax, torch.Tensor) and absmax.dim() > 1:
        absmax = absmax.reshape(-1)
    return QF.dequantize_blockwise(A, quant_state, absmax, code, out, blocksize, nested)


def _check_4bit_outs(A: torch.Tensor, absmax: object, out: object, blocksize: object, quant_storage: object) -> None:
    """``out`` and ``absmax`` of :func:`quantize_4bit`, when the format is valid enough to size
    them (an invalid one is refused by tightfit's own quantize_4bit, before any work)."""
    if isinstance(quant_storage, torch.dtype) and isinstance(blocksize, int) and blocksize > 0:
        count = packed_bytes(A.numel()) // quant_storage.itemsize
        check_out("out", out, (count, 1), quant_storage, A)
        check_out("absmax", absmax, (block_count(A.numel(), blocksize),), torch.float32, A)


def quantize_4bit(
    A: torch.Tensor,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    compress_statistics: bool = False,
    quant_type: str = "fp4",
    quant_storage: torch.dtype = torch.uint8,
) -> tuple[torch.Tensor, QuantState]:
    """4-bit (NF4 / FP4) quantization: (packed codes shaped (bytes / itemsize, 1), QuantState)."""
    A = _tensor("A", A)
    _check_4bit_outs(A, absmax, out, 64 if blocksize is None else blocksize, quant_storage)
    return QF.quantize_4bit(A, absmax, out, blocksize, compress_statistics, quant_type, quant_storage)


def dequantize_4bit(
    A: torch.Tensor,
    quant_state: QuantState | None = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    quant_type: str = "fp4",
) -> torch.Tensor:
    """Decode packed 4-bit codes. As in bitsandbytes, codes passed as a (1, n) row (the
    transposed view of the packed column) give the weight transposed, (in, out)."""
    A = _tensor("A", A)
    if isinstance(quant_state, QuantState) and quant_state.shape is not None:
        check_out("out", out, tuple(quant_state.shape), quant_state.dtype, A)
    elif out is not None:
        check_same_device("out", _tensor("out", out), "A", A)
    result = QF.dequantize_4bit(A, quant_state, absmax, out, blocksize, quant_type)
    return result.t() if A.dim() == 2 and A.shape[0] == 1 and result.dim() == 2 else result


quantize_nf4 = fixed_argument(quantize_4bit, "quant_type", "nf4", qualname="quantize_nf4")
quantize_fp4 = fixed_argument(quantize_4bit, "quant_type", "fp4", qualname="quantize_fp4")
dequantize_nf4 = fixed_argument(dequantize_4bit, "quant_type", "nf4", qualname="dequantize_nf4")
dequantize_fp4 = fixed_argument(dequantize_4bit, "quant_type", "fp4", qualname="dequantize_fp4")


def _check_product(
    A: object, B: object, out: object, transposed_A: object, transposed_B: object, state: object
) -> torch.Tensor:
    """``A``, checked with the other arguments of ``A @ W.T`` for a 4-bit weight (``B``'s bytes
    against the state's shape, ``out`` against the product's) before any work; refuses what
    bitsandbytes would silently ignore."""
    A = _tensor("A", A)
    check_type("transposed_B", transposed_B, bool)
    check_type("transposed_A", transposed_A, bool)
    if transposed_A:
        raise ValueError("transposed_A=True is not supported; pass A as (..., in_features)")
    check_type("state", state, QuantState)
    if state.shape is None or len(state.shape) != 2:
        raise ValueError("state must describe a 4-bit weight of shape (out_features, in_features)")
    if A.dim() < 1 or A.shape[-1] != state.shape[1]:
        raise ValueError(f"A has shape {tuple(A.shape)}; its last dimension must be in_features, {state.shape[1]}")
    check_packed("B", B, math.prod(state.shape), list(state.shape))
    check_out("out", out, (*A.shape[:-1], state.shape[0]), A.dtype, A)
    return A


def gemv_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    transposed_A: bool = False,
    transposed_B: bool = False,
    state: QuantState | None = None,
) -> torch.Tensor:
    """``A @ dequantize(B).T``, decoding the weight inside the product (the decode kernel).
    Packed codes are read in memory order whatever view ``B`` is (its column or the
    transposed row), so ``transposed_B`` changes nothing, as in bitsandbytes."""
    A = _check_product(A, B, out, transposed_A, transposed_B, state)
    return QF.gemv_4bit(A, B, out, state=state)


def gemm_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    transposed_A: bool = False,
    transposed_B: bool = False,
    state: QuantState | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A @ dequantize(B).T + bias`` in ``A``'s dtype for any number of rows (bitsandbytes'
    ``gemm_4bit`` op, with :func:`gemv_4bit`'s arguments): one row runs the decode kernel,
    more decode the weight once and multiply, as bitsandbytes' CPU path does."""
    A = _check_product(A, B, out, transposed_A, transposed_B, state)
    check_bias(bias, state.shape[0], A)
    return QF.matmul_4bit(A, B, state, out, bias)


def has_avx512bf16() -> bool:
    """Always False, whatever the CPU. bitsandbytes answers True where its native CPU library
    repacks 4-bit weights into an AVX512-bf16 layout (``_convert_weight_packed_for_cpu``) and
    computes fp16/fp32 inputs in bf16; its callers then take that path. tightfit does neither:
    4-bit weights keep the portable packed layout on every device and no fp16/fp32 input is
    cast to bf16, so the callers' portable path is the right one."""
    return False


def get_4bit_type(typename: str, device: torch.device | str | None = None, blocksize: int = 64) -> torch.Tensor:
    """The 16 values of a 4-bit code in code order, scaled to [-1, 1]. ``device`` None is
    the CPU (bitsandbytes defaults to CUDA); ``blocksize`` is accepted for compatibility."""
    check_type("typename", typename, str)
    check_choice("typename", typename, QUANT_TYPES_4BIT)
    return ops.code_4bit(typename).to("cpu" if device is None else device, copy=True)


def int8_linear_matmul(
    A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """Exact ``A @ B.T`` of int8 matrices as int32 (the only ``dtype`` bitsandbytes accepts)."""
    A, B = _tensor("A", A), _tensor("B", B)
    if B.dim() == 2:  # any other B is refused by tightfit's int8_linear_matmul, before ``out`` is used
        check_out("out", out, (*A.shape[:-1], B.shape[0]), torch.int32, A)
    return QF.int8_linear_matmul(A, B, out, dtype)


def int8_mm_dequant(
    A: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Scale an int32 product back to floats (+ ``bias``). ``dtype`` (an addition to
    bitsandbytes' signature) defaults to ``out``'s, else float16 as in bitsandbytes."""
    A = _tensor("A", A)
    if out is not None:
        check_out("out", out, tuple(A.shape), _tensor("out", out).dtype if dtype is None else dtype, A)
    return QF.int8_mm_dequant(A, row_stats, col_stats, out, bias, dtype=dtype)


def int8_scaled_mm(
    A: torch.Tensor,
    B: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """int8 ``A @ B.T`` scaled back by ``row_stats`` and ``col_stats`` (+ ``bias``), as ``dtype``
    (float16 by default): :func:`int8_linear_matmul` then :func:`int8_mm_dequant`, as
    bitsandbytes' ``int8_scaled_mm`` op computes it."""
    return QF.int8_mm_dequant(QF.int8_linear_matmul(A, B), row_stats, col_stats, bias=bias, dtype=dtype)


_MAP_SIZE = 256  # maps are indexed by a byte; narrower types are padded with zeros


def _check_bits(name: str, value: object, low: int, high: int) -> int:
    check_type(name, value, int)
    if isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: an int from {low} to {high}")
    return value


def _padded(values: list[float]) -> list[float]:
    return values + [0.0] * (_MAP_SIZE - len(values))


def create_linear_map(signed: bool = True, total_bits: int = 8, add_zero: bool = True) -> torch.Tensor:
    """Evenly spaced values from -1 (or 0, unsigned) to 1; a signed map with a zero has
    one value fewer (``2**total_bits - 1``), so that zero is exactly representable."""
    check_type("signed", signed, bool)
    check_type("add_zero", add_zero, bool)
    total_bits = _check_bits("total_bits", total_bits, 1, 8)
    count = 2**total_bits
    if signed and (add_zero or total_bits < 8):
        count -= 1
    values = torch.linspace(-1.0 if signed else 0.0, 1.0, count, dtype=torch.float32)
    if count == _MAP_SIZE:
        return values
    half = count // 2  # zeros go in the middle, where bitsandbytes puts them
    return torch.tensor(values[:half].tolist() + [0.0] * (_MAP_SIZE - count) + values[half:].tolist())


def create_normal_map(offset: float = 0.9677083, use_extra_value: bool = True) -> torch.Tensor:
    """The NormalFloat map (NF4's 16 values, zero-padded to 256, sorted): normal quantiles
    from ``offset`` to the median, 8 (7 without ``use_extra_value``) positive and 7 negative,
    scaled so the largest is 1."""
    check_type("offset", offset, (int, float))
    check_type("use_extra_value", use_extra_value, bool)
    if isinstance(offset, bool) or not 0.5 < offset < 1.0:
        raise ValueError(f"offset={offset!r} is not accepted; accepted: a number between 0.5 and 1 (exclusive)")

    def quantiles(count: int) -> list[float]:
        # the float32 grid bitsandbytes passes to scipy's norm.ppf; float64 inverse CDF
        grid = torch.linspace(offset, 0.5, count, dtype=torch.float32)[:-1]
        return torch.special.ndtri(grid.double()).tolist()

    positive = quantiles(9 if use_extra_value else 8)
    negative = [-value for value in quantiles(8)]
    values = torch.tensor(_padded(positive + negative), dtype=torch.float32).sort().values
    return values / values.max()


def create_fp8_map(
    signed: bool = True, exponent_bits: int = 5, precision_bits: int = 2, total_bits: int = 8
) -> torch.Tensor:
    """Every value of a small float format (exponent bias ``2**(exponent_bits - 1)``,
    subnormals at exponent 0), sorted, zero-padded to 256 and scaled so the largest is 1;
    ``exponent_bits=2, precision_bits=1, total_bits=4`` is FP4."""
    check_type("signed", signed, bool)
    total_bits = _check_bits("total_bits", total_bits, 1, 8)
    exponent_bits = _check_bits("exponent_bits", exponent_bits, 0, total_bits)
    precision_bits = _check_bits("precision_bits", precision_bits, 0, total_bits)
    if exponent_bits + precision_bits != total_bits - signed:
        raise ValueError(
            f"exponent_bits + precision_bits must be total_bits - {int(signed)} (the sign bit); "
            f"got {exponent_bits} + {precision_bits} with total_bits={total_bits}"
        )
    bias = 2 ** (exponent_bits - 1)
    values: list[float] = []
    for exponent in range(2**exponent_bits):
        for mantissa in itertools.product((0, 1), repeat=precision_bits):
            fraction = sum(bit * 2.0 ** -(place + 1) for place, bit in enumerate(mantissa))
            if exponent == 0:  # subnormal: no implicit leading one
                value = fraction * 2.0**-bias
            else:
                value = (1 + fraction) * 2.0 ** -(exponent - bias - 1)
            values.append(value)
            if signed:
                values.append(-value)
    code = torch.tensor(sorted(_padded(sorted(values))), dtype=torch.float32)
    return code / code.max()


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """The dynamic map (8-Bit Approximations for Parallelism in Deep Learning), sorted and
    zero-padded to 256: :func:`tightfit.ops.codes.dynamic_values`, which also builds the
    map 8-bit blockwise quantization uses (:func:`tightfit.ops.dynamic_map`, the defaults)."""
    check_type("signed", signed, bool)
    total_bits = _check_bits("total_bits", total_bits, 2, 8)
    max_exponent_bits = _check_bits("max_exponent_bits", max_exponent_bits, 1, total_bits - 1)
    values = dynamic_values(signed, max_exponent_bits, total_bits)
    if len(values) != 2**total_bits:
        raise ValueError(
            f"signed={signed}, max_exponent_bits={max_exponent_bits}, total_bits={total_bits} give "
            f"{len(values)} values, not 2**total_bits = {2**total_bits}; bitsandbytes refuses them too"
        )
    return torch.tensor(sorted(_padded(values)), dtype=torch.float32)
