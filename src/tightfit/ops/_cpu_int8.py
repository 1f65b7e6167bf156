"""Fast exact int8 matmul on the CPU (``A @ B.T`` into int32).

Without AVX-512 VNNI, torch's ``_int_mm`` falls back to scalar code, 20-40x slower than a
float32 GEMM. Two exact ways around it:

- many rows: a float32 GEMM of the int8 values, as bitsandbytes does, but only where it
  is exact: while no row's sum of |products| passes 2**24, every partial sum in whatever
  order the GEMM adds is an integer float32 holds. Checked per call (K * max|A| * max|B|,
  then each row's L1 norm * max|B|); past it, or where the user let float32 GEMMs round
  (TF32/bf16 modes), float64 (exact to 2**53, wrapped to int32 as int32 accumulation wraps).
- few rows (decoding): converting B to float would dominate, so a numba kernel reads B's
  int8 bytes once, all rows of A at a time, with int32 accumulation (``_int_mm`` where
  numba is missing).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tightfit.ops._numba import kernel_lock, load_numba, usable_numba

__all__: list[str] = []

#: float32 holds every integer up to 2**24 exactly.
EXACT_FLOAT32 = 1 << 24
#: At most this many rows go through the byte-reading kernel; above, the float GEMM wins.
FEW_ROWS = 16


def _float32_is_ieee() -> bool:
    """False where the user let float32 GEMMs round their inputs (TF32/bf16 modes)."""
    precision = torch.backends.mkldnn.matmul.fp32_precision
    return torch.get_float32_matmul_precision() == "highest" and precision in ("none", "ieee")


def _largest(tensor: torch.Tensor) -> int:
    low, high = torch.aminmax(tensor)
    return max(-int(low), int(high))


def _fits_float32(A: torch.Tensor, B: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether no row of ``A`` (``a`` in float32) can sum past 2**24 with any row of ``B``:
    its L1 norm times B's largest value caps every partial sum, in any order."""
    largest_b = _largest(B)
    bound = A.shape[1] * _largest(A) * largest_b
    if bound > EXACT_FLOAT32:
        bound = int(torch.linalg.vector_norm(a, 1, dim=1).amax()) * largest_b
    return bound <= EXACT_FLOAT32


def _float_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """In float32 where that is exact, else in float64."""
    a = A.float()
    if _float32_is_ieee() and _fits_float32(A, B, a):
        return (a @ B.float().t()).to(torch.int32)
    return (A.double() @ B.double().t()).to(torch.int64).to(torch.int32)


@functools.lru_cache(maxsize=1)
def _few_rows_kernel():
    numba, _ = load_numba()

    @numba.njit(parallel=True, nogil=True, cache=True)
    def few_rows(a, b, out):
        """out[m, n] = sum_k a[m, k] * b[n, k] in int32; each row of ``b`` is read once, for all rows of ``a``."""
        for n in numba.prange(b.shape[0]):
            for m in range(a.shape[0]):
                acc = np.int32(0)
                for k in range(a.shape[1]):
                    acc += np.int32(a[m, k]) * np.int32(b[n, k])
                out[m, n] = acc

    return few_rows


def linear_matmul_cpu(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Exact ``A @ B.T`` for int8 ``A`` (M, K) and ``B`` (N, K), both checked by the op."""
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return torch._int_mm(A.contiguous(), B.t())  # oneDNN's int8 GEMM is fast there (bitsandbytes' rule)
    if A.shape[0] > FEW_ROWS:
        return _float_matmul(A, B)
    if usable_numba("int8_linear_matmul", "few-row products use torch._int_mm") is None:
        return torch._int_mm(A.contiguous(), B.t())
    out = torch.empty(A.shape[0], B.shape[0], dtype=torch.int32)
    with kernel_lock:
        _few_rows_kernel()(A.contiguous().numpy(), B.contiguous().numpy(), out.numpy())
    return out
