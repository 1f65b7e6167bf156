"""The numba kernel of ``_cpu_cast`` (imported there at first use: it imports numba).

At module level, like the other kernel modules, so numba's on-disk cache keys it by its
bytecode and signature only, the same in every process (see ``_kernels_blockwise``).
"""

from __future__ import annotations

import numba

__all__ = ["gather"]


@numba.njit(parallel=True, nogil=True, cache=True)
def gather(src, table, dst):
    """dst[i] = table[src[i]]."""
    for i in numba.prange(src.shape[0]):
        dst[i] = table[src[i]]
