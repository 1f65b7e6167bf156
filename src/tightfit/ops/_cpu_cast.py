"""Fast CPU kernels for float8 storage casts.

Casts from an 8- or 16-bit type are table lookups: the table is built by torch's own
conversion over every bit pattern, so results are bit-identical to torch by
construction (NaN payloads, subnormals and saturation included). Two 8-bit inputs are
looked up at once (a 65536-entry table of pairs) to halve the memory operations.
float32 -> e4m3fn / e5m2 follows c10's rounding (round to nearest even; e4m3fn
overflows to NaN, e5m2 to inf). Everything else uses torch's native cast.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np
import torch

from tightfit._hugepages import empty_with_huge_pages
from tightfit._strict import report_fallback
from tightfit.backends.base import FLOAT8_DTYPES
from tightfit.ops._numba import load_numba, match_torch_threads

__all__ = ["cast_cpu", "cast_into_cpu"]

#: Below this many elements torch's own cast is faster than a parallel kernel launch.
MIN_FAST_NUMEL = 1 << 15

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_TORCH_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class _Fp32ToFp8:
    """c10's float32 -> float8 rounding constants, on the magnitude bits."""

    overflow_bits: int  # magnitudes at or above this overflow
    overflow_code: int
    nan_code: int
    subnormal_below: int  # magnitudes below this are subnormal in the target
    subnormal_scale: float  # 1 / the target's smallest subnormal
    exponent_shift: int  # (target bias - 127) << 23
    mantissa_drop: int  # 23 - target mantissa bits
    forbidden_code: int  # a rounded code that saturates to the one below it; -1 for none


# torch changed e4m3fn overflow from NaN to saturation (max finite); the first rule that
# matches the installed torch on the probe values is used (see _fp32_rule).
_FP32_TO_FP8_RULES = {
    torch.float8_e4m3fn: (
        _Fp32ToFp8(1087 << 20, 0x7E, 0x7F, 121 << 23, 2.0**9, (7 - 127) << 23, 20, 0x7F),
        _Fp32ToFp8(1087 << 20, 0x7F, 0x7F, 121 << 23, 2.0**9, (7 - 127) << 23, 20, -1),
    ),
    torch.float8_e5m2: (_Fp32ToFp8(143 << 23, 0x7C, 0x7F, 113 << 23, 2.0**16, (15 - 127) << 23, 21, -1),),
}


def float32_probe_values() -> torch.Tensor:
    """float32 values on and next to every float8 rounding boundary, specials, random bits."""
    bf16_exact = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int64) << 16
    neighbours = [bf16_exact + delta for delta in (0, -1, 1, 1 << 14, (1 << 15) - 1, 1 << 15, (1 << 15) + 1)]
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(0, 1 << 32, (1 << 16,), generator=generator, dtype=torch.int64)
    bits = (torch.cat([*neighbours, random]) & 0xFFFFFFFF).to(torch.int32)  # wraps to the bit pattern
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, 464.0, 480.0, 57344.0, 61440.0]
        + [2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 1e-45]
    )
    return torch.cat([bits.view(torch.float32), specials])


@functools.lru_cache(maxsize=1)
def _kernels():
    numba, _ = load_numba()

    @numba.njit(parallel=True, nogil=True, cache=True)
    def gather(src, table, dst):
        for i in numba.prange(src.shape[0]):
            dst[i] = table[src[i]]

    @numba.njit(parallel=True, nogil=True, cache=True)
    def fp32_to_fp8(bits, values, dst, overflow_bits, overflow_code, nan_code, subnormal_below, subnormal_scale, exponent_shift, mantissa_drop, forbidden_code):
        for i in numba.prange(bits.shape[0]):
            word = np.int64(bits[i])
            sign = (word >> 24) & 0x80
            magnitude = word & 0x7FFFFFFF
            if magnitude >= overflow_bits:
                code = nan_code if magnitude > 0x7F800000 else overflow_code
            elif magnitude < subnormal_below:
                code = np.int64(np.rint(abs(np.float64(values[i])) * subnormal_scale))
            else:
                odd = (magnitude >> mantissa_drop) & 1
                rounded = magnitude + exponent_shift + ((1 << (mantissa_drop - 1)) - 1) + odd
                code = (rounded >> mantissa_drop) & 0xFF
                if code == forbidden_code:
                    code -= 1
            dst[i] = code | sign

    return gather, fp32_to_fp8


def _run_fp32_rule(rule: _Fp32ToFp8, x: torch.Tensor, out: torch.Tensor) -> None:
    _, fp32_to_fp8 = _kernels()
    fp32_to_fp8(
        _as_unsigned(x), x.numpy(), _as_unsigned(out), rule.overflow_bits, rule.overflow_code, rule.nan_code,
        rule.subnormal_below, rule.subnormal_scale, rule.exponent_shift, rule.mantissa_drop, rule.forbidden_code,
    )


@functools.lru_cache(maxsize=None)
def _fp32_rule(dst: torch.dtype) -> _Fp32ToFp8 | None:
    """The rounding rule that reproduces this torch's float32 -> ``dst`` cast, or None."""
    probe = float32_probe_values()
    expected = probe.to(dst).view(torch.uint8)
    for rule in _FP32_TO_FP8_RULES.get(dst, ()):
        got = torch.empty(probe.shape, dtype=dst)
        _run_fp32_rule(rule, probe, got)
        if torch.equal(got.view(torch.uint8), expected):
            return rule
    return None


def _bits(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=None)
def _table(src: torch.dtype, dst: torch.dtype, pairs: bool) -> np.ndarray:
    """Every source bit pattern cast by torch; with ``pairs``, two 8-bit inputs per entry."""
    width = _bits(src)
    patterns = torch.from_numpy(np.arange(1 << (8 * width), dtype=_UNSIGNED[width]).view(f"i{width}" if width > 1 else "u1"))
    converted = patterns.view(src).to(dst).view(_TORCH_SAME_WIDTH[_bits(dst)]).numpy().view(_UNSIGNED[_bits(dst)])
    if not pairs:
        return np.ascontiguousarray(converted)
    low = converted.astype(np.uint32)
    # entry (b << 8) | a holds the outputs of a (first in memory) and b, little-endian
    return np.ascontiguousarray(low[None, :] | (low[:, None] << np.uint32(16))).reshape(-1)


def _as_unsigned(tensor: torch.Tensor) -> np.ndarray:
    width = tensor.element_size()
    return tensor.view(_TORCH_SAME_WIDTH[width]).numpy().view(_UNSIGNED[width])


def _fast_into(x: torch.Tensor, out: torch.Tensor) -> bool:
    """Cast contiguous 1-D ``x`` into contiguous 1-D ``out``; False where no fast path applies."""
    src, dst = x.dtype, out.dtype
    if src not in FLOAT8_DTYPES and dst not in FLOAT8_DTYPES:
        return False
    src_width, dst_width = _bits(src), _bits(dst)
    gather, _ = _kernels()
    if src_width == 4:
        rule = _fp32_rule(dst) if src == torch.float32 else None
        if rule is None:
            return False
        _run_fp32_rule(rule, x, out)
        return True
    if src_width == 1 and dst_width == 2 and sys.byteorder == "little":
        even = x.numel() - (x.numel() % 2)
        gather(_as_unsigned(x[:even]).view(np.uint16), _table(src, dst, True), _as_unsigned(out[:even]).view(np.uint32))
        if even < x.numel():
            out[even:].copy_(x[even:])
        return True
    gather(_as_unsigned(x), _table(src, dst, False), _as_unsigned(out))
    return True


def cast_into_cpu(x: torch.Tensor, out: torch.Tensor) -> None:
    """CPU kernel of ``tightfit::cast_into``."""
    if x.numel() >= MIN_FAST_NUMEL and (x.dtype in FLOAT8_DTYPES or out.dtype in FLOAT8_DTYPES):
        numba, why_not = load_numba()
        if numba is None:
            report_fallback("cast", "cpu", "reference", f"{why_not}; using torch's cast")
        else:
            match_torch_threads(numba)
            target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
            if _fast_into(x.contiguous().view(-1), target.view(-1)):
                if target is not out:
                    out.copy_(target)
                return
    out.copy_(x)


def cast_cpu(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """CPU kernel of ``tightfit::cast``; a large result is backed by huge pages."""
    out = empty_with_huge_pages(x.shape, dtype)
    cast_into_cpu(x, out)
    return out
