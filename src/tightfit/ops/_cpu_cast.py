"""Fast CPU kernels for float8 storage casts.

Casts from an 8- or 16-bit type are table lookups: the table is built by torch's own
conversion over every bit pattern, so results are bit-identical to torch by
construction (NaN payloads, subnormals and saturation included). Two 8-bit inputs are
looked up at once (a 65536-entry table of pairs) to halve the memory operations.
From float32 torch's own cast is vectorized and as fast as a kernel of ours, so it is
used as is. Large results are backed by huge pages either way.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from tightfit.backends.base import FLOAT8_DTYPES
from tightfit.ops._hugepages import empty_with_huge_pages
from tightfit.ops._numba import kernel_lock, usable_numba

__all__ = ["cast_cpu", "cast_into_cpu"]

#: Below this many elements torch's own cast is faster than a parallel kernel launch.
MIN_FAST_NUMEL = 1 << 15

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_TORCH_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _kernels():
    """The lookup kernel (``_kernels_cast.gather``), imported at first use: it imports numba."""
    from tightfit.ops._kernels_cast import gather

    return gather


@functools.cache
def _table(src: torch.dtype, dst: torch.dtype, pairs: bool) -> np.ndarray:
    """Every source bit pattern cast by torch; with ``pairs``, two 8-bit inputs per entry."""
    width = src.itemsize
    patterns = torch.from_numpy(
        np.arange(1 << (8 * width), dtype=_UNSIGNED[width]).view(f"i{width}" if width > 1 else "u1")
    )
    converted = patterns.view(src).to(dst).view(_TORCH_SAME_WIDTH[dst.itemsize]).numpy().view(_UNSIGNED[dst.itemsize])
    if not pairs:
        return np.ascontiguousarray(converted)
    low = converted.astype(np.uint32)
    # entry (b << 8) | a holds the outputs of a (first in memory) and b, little-endian
    return np.ascontiguousarray(low[None, :] | (low[:, None] << np.uint32(16))).reshape(-1)


def _as_unsigned(tensor: torch.Tensor) -> np.ndarray:
    width = tensor.element_size()
    return tensor.view(_TORCH_SAME_WIDTH[width]).numpy().view(_UNSIGNED[width])


def _has_table(src: torch.dtype, dst: torch.dtype) -> bool:
    """A float8 cast from an 8- or 16-bit type: what the lookup kernel does."""
    return src.itemsize <= 2 and dst.itemsize in _UNSIGNED and (src in FLOAT8_DTYPES or dst in FLOAT8_DTYPES)


def _lookup_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Cast contiguous 1-D ``x`` into contiguous 1-D ``out`` by table lookup."""
    gather = _kernels()
    src, dst = x.dtype, out.dtype
    if src.itemsize == 1 and dst.itemsize == 2 and sys.byteorder == "little":
        even = x.numel() - (x.numel() % 2)
        gather(_as_unsigned(x[:even]).view(np.uint16), _table(src, dst, True), _as_unsigned(out[:even]).view(np.uint32))
        if even < x.numel():
            out[even:].copy_(x[even:])
        return
    gather(_as_unsigned(x), _table(src, dst, False), _as_unsigned(out))


def _cast_into(x: torch.Tensor, out: torch.Tensor, op: str) -> None:
    if x.numel() < MIN_FAST_NUMEL or not _has_table(x.dtype, out.dtype):
        out.copy_(x)
        return
    if usable_numba(op, "using torch's cast") is None:
        out.copy_(x)
        return
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
    with kernel_lock:
        _lookup_into(x.contiguous().view(-1), target.view(-1))
    if target is not out:
        out.copy_(target)


def cast_into_cpu(x: torch.Tensor, out: torch.Tensor) -> None:
    """CPU kernel of ``tightfit::cast_into``."""
    _cast_into(x, out, "cast_into")


def cast_cpu(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """CPU kernel of ``tightfit::cast``; a large result is backed by huge pages."""
    out = empty_with_huge_pages(x.shape, dtype)
    _cast_into(x, out, "cast")
    return out
