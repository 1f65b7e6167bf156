"""Lazy access to numba for the fast CPU kernels.

numba is imported at the first kernel call, never at ``import tightfit``; where it is
missing or broken the CPU kernels fall back to the reference, with the D1 warning.

The kernels are compiled once per machine: they are module-level functions of the
``_kernels_*`` modules (imported at first use) with ``cache=True``, so later processes
load them from numba's disk cache (``__pycache__`` beside the source, numba's user cache
directory where that is read-only, or ``NUMBA_CACHE_DIR``). Never define a cached kernel
in a closure that captures another jitted function: numba's cache key hashes a pickle of
the closure's cells, a dispatcher pickles with a per-process uuid, and the kernel would
compile again, adding a cache file, in every process (tests/ops/test_kernel_cache.py).
"""

from __future__ import annotations

import functools
import threading
from types import ModuleType

import torch

from tightfit._strict import report_fallback

__all__: list[str] = []

#: numba's workqueue threading layer aborts when two threads launch parallel kernels at once.
kernel_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def load_numba() -> tuple[ModuleType | None, str | None]:
    """(numba, None), or (None, why it cannot be used)."""
    try:
        import numba
    except Exception as error:  # ImportError, or a numpy/llvmlite mismatch at import
        return None, f"numba is not usable ({type(error).__name__}: {error})"
    return numba, None


def match_torch_threads(numba: ModuleType) -> None:
    """Use as many threads as torch's intra-op pool, so the two never oversubscribe; and
    keep torch's count: numba's OpenMP layer, launched here, sets the process's OpenMP
    threads to all of numba's, which torch's pool is (a process given one thread, as each
    of torchrun's ranks is, would run torch on every core from the first kernel on)."""
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def usable_numba(op: str, instead: str) -> ModuleType | None:
    """numba set to torch's thread count, or None after reporting the fallback for ``op`` (D1)."""
    numba, why_not = load_numba()
    if numba is None:
        report_fallback(op, "cpu", "reference", f"{why_not}; {instead}")
        return None
    match_torch_threads(numba)
    return numba
