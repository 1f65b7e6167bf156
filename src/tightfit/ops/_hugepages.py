"""Transparent huge pages for large fresh CPU buffers (private).

A fresh multi-MiB tensor costs one page fault per 4 KiB on first touch, which on the
CPU costs as much as a memory-bound kernel itself. Advising the kernel to back the
buffer with 2 MiB pages (Linux ``madvise(MADV_HUGEPAGE)``) removes almost all of them.
Nothing changes where the OS has no transparent huge pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from pathlib import Path

import torch

__all__: list[str] = []

_HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise where transparent huge pages can be asked for, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return None
    if "[never]" in mode:
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def empty_with_huge_pages(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on the CPU whose whole 2 MiB pages are advised to be huge pages."""
    tensor = torch.empty(shape, dtype=dtype)
    madvise = _madvise()
    nbytes = tensor.numel() * tensor.element_size()
    if madvise is None or nbytes < 2 * _HUGE_PAGE:
        return tensor
    start = (tensor.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (tensor.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
    if end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal leaves 4 KiB pages
    return tensor
