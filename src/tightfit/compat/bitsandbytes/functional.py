"""``bitsandbytes.functional`` on tightfit: ``import tightfit.compat.bitsandbytes.functional
as F`` in place of ``import bitsandbytes.functional as F``.

The quantization functions are :mod:`tightfit.quant.functional`'s (same names, argument
names and defaults). The code-map constructors build bitsandbytes' maps the way it builds
them, so they are bit-equal to its own on the CPU; ``create_normal_map`` uses torch's
inverse normal CDF, where bitsandbytes needs scipy.
"""

from __future__ import annotations

import itertools

import torch

from tightfit._validate import check_type
from tightfit.ops.codes import dynamic_values
from tightfit.quant.functional import (
    QuantState,
    dequantize_4bit,
    dequantize_blockwise,
    dequantize_fp4,
    dequantize_nf4,
    gemv_4bit,
    int8_linear_matmul,
    int8_mm_dequant,
    int8_vectorwise_dequant,
    int8_vectorwise_quant,
    quantize_4bit,
    quantize_blockwise,
    quantize_fp4,
    quantize_nf4,
)

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
    "gemv_4bit",
    "int8_linear_matmul",
    "int8_mm_dequant",
    "int8_vectorwise_dequant",
    "int8_vectorwise_quant",
    "quantize_4bit",
    "quantize_blockwise",
    "quantize_fp4",
    "quantize_nf4",
]

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
