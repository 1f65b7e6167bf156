"""The numba kernel of ``_cpu_int8`` (imported there at first use: it imports numba).

At module level, like the other kernel modules, so numba's on-disk cache keys it by its
bytecode and signature only, the same in every process (see ``_kernels_blockwise``).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["few_rows"]


@numba.njit(parallel=True, nogil=True, cache=True)
def few_rows(a, b, out):
    """out[m, n] = sum_k a[m, k] * b[n, k] in int32; each row of ``b`` is read once, for all rows of ``a``."""
    for n in numba.prange(b.shape[0]):
        for m in range(a.shape[0]):
            acc = np.int32(0)
            for k in range(a.shape[1]):
                acc += np.int32(np.int16(a[m, k]) * np.int16(b[n, k]))
            out[m, n] = acc
