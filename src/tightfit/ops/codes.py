"""The quantization maps that bitsandbytes defines, built the same way so codes match.

``dynamic_map()`` is the signed 8-bit dynamic map (256 float32 values, sorted);
``code_4bit("nf4" | "fp4")`` the 16 values of a 4-bit type, in code order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["DYNAMIC_MAP_SHA256", "QUANT_TYPES_4BIT", "code_4bit", "dynamic_map", "dynamic_values", "real_constant"]

T = TypeVar("T")

#: SHA-256 of the dynamic map's float32 bytes, as bitsandbytes 0.50 builds it.
DYNAMIC_MAP_SHA256 = "e732639a65f497b4ad684bb166a4467708255edd5207757de8b8f0c7e1fda89c"
QUANT_TYPES_4BIT = ("nf4", "fp4")

_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]
# FP4 (bit 3 is the sign): magnitudes in code order, scaled so the largest is 1.
_FP4_MAGNITUDES = [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0]


def dynamic_values(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> list[float]:
    """The values of a dynamic map, as bitsandbytes' ``create_dynamic_map`` builds them
    (unsorted, not padded; arguments unchecked: the caller's): for each exponent i, the
    midpoints of an even split of [0.1, 1] scaled by 10**(i + 1 - max_exponent_bits), the
    split coarser as the exponent shrinks; values at the top scale for the fraction bits
    beyond the largest exponent field; then 0 and 1."""
    fraction_bits = total_bits - 1 - max_exponent_bits

    def midpoints(count: int, scale: float) -> list[float]:
        bounds = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        return (scale * means).tolist() + ((-scale * means).tolist() if signed else [])

    values: list[float] = []
    for exponent in range(max_exponent_bits):
        values += midpoints(2 ** (exponent + fraction_bits + (not signed)), 10.0 ** (exponent + 1 - max_exponent_bits))
    if fraction_bits > 0:  # all exponent bits zero, no indicator bit: more values at the top scale
        values += midpoints(2**fraction_bits - 1, 1.0)
    return values + [0.0, 1.0]


def real_constant(build: Callable[..., T]) -> Callable[..., T]:
    """``build`` (a cached table's builder) run outside any fake tensor mode: a table built
    while a skeleton is converted under one (to plan its memory) would be a fake tensor,
    and the cache would serve it to real calls after."""

    @functools.wraps(build)
    def built(*args: Any) -> T:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return build(*args)

    return built


@functools.lru_cache(maxsize=2)
@real_constant
def _dynamic_map(signed: bool = True) -> torch.Tensor:
    return torch.tensor(sorted(dynamic_values(signed)), dtype=torch.float32)


def dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 8-bit dynamic map, 256 sorted float32 values (a copy): signed, from -0.99297 to
    1; unsigned (``signed=False``, the map of 8-bit optimizers' second moments), from 0 to 1."""
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be bool, got {type(signed).__name__}: {signed!r}")
    return _dynamic_map(signed).clone()


@functools.cache
@real_constant
def _code_4bit(quant_type: str) -> torch.Tensor:
    if quant_type == "nf4":
        return torch.tensor(_NF4, dtype=torch.float32)
    # code 8 is +0.0, not -0.0, as bitsandbytes has it: decoding stays bit-identical
    table = torch.tensor(_FP4_MAGNITUDES + [-m or 0.0 for m in _FP4_MAGNITUDES], dtype=torch.float32)
    return table / table.abs().max()


def code_4bit(quant_type: str) -> torch.Tensor:
    """The 16 float32 values of ``quant_type`` ("nf4" or "fp4"), indexed by code (a copy)."""
    if quant_type not in QUANT_TYPES_4BIT:
        raise ValueError(f"quant_type={quant_type!r} is not accepted; accepted: nf4, fp4")
    return _code_4bit(quant_type).clone()
