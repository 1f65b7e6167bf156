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


# -- row-wise quantization and dequantization of the product: one pass each, no temporaries --


@functools.lru_cache(maxsize=1)
def _row_kernels():
    numba, _ = load_numba()

    @numba.njit(parallel=True, nogil=True, cache=True)
    def vectorwise_quant(bits, threshold, q, row_stats, outlier, bad):
        """Per row of float32 (or bf16, widened) ``bits``: the largest |x| below ``threshold``,
        then round(x * (127 / it)) half to even, outliers coded 0 and their columns flagged
        (every flag written is 1, so rows racing on one are harmless). A row holding NaN or
        inf is only flagged in ``bad``."""
        widen = np.uint32(1 << (32 - 8 * bits.itemsize))  # a multiply, not a shift, so it stays 32-bit
        for r in numba.prange(bits.shape[0]):
            largest = np.float32(0.0)
            for k in range(bits.shape[1]):
                value = abs(np.uint32(np.uint32(bits[r, k]) * widen).view(np.float32))
                if not np.isfinite(value):
                    bad[r] = 1
                elif value < threshold and value > largest:
                    largest = value
            if bad[r]:
                continue
            row_stats[r] = largest
            scale = np.float32(127.0) / largest if largest > 0 else np.float32(0.0)
            for k in range(bits.shape[1]):
                value = np.uint32(np.uint32(bits[r, k]) * widen).view(np.float32)
                if abs(value) < threshold:  # adding and taking 1.5 * 2**23 rounds |x| <= 128 half to even
                    q[r, k] = np.int8((value * scale + np.float32(12582912.0)) - np.float32(12582912.0))
                else:
                    q[r, k] = 0
                    outlier[k] = 1

    @numba.njit(parallel=True, nogil=True, cache=True)
    def mm_dequant(product, row_stats, col_stats, scale, bias, out):
        """out = float32(product) * (row_stats * col_stats) * scale (+ bias), in that order, in float32."""
        for r in numba.prange(product.shape[0]):
            if bias.shape[0] == 0:
                for c in range(product.shape[1]):
                    out[r, c] = np.float32(product[r, c]) * (row_stats[r] * col_stats[c]) * scale
            else:
                for c in range(product.shape[1]):
                    out[r, c] = np.float32(product[r, c]) * (row_stats[r] * col_stats[c]) * scale + bias[c]

    return vectorwise_quant, mm_dequant


def vectorwise_quant_cpu(rows: torch.Tensor, threshold: float, reference):
    """``reference()``'s (q, row_stats, outlier_cols) for float32 or bf16 (rows, K) ``rows``;
    float16, and input with NaN or inf, go to the reference."""
    if rows.dtype == torch.float16 or usable_numba("int8_vectorwise_quant", "running the reference kernel") is None:
        return reference()
    rows = rows.contiguous()
    bits = rows.view(torch.int32 if rows.dtype == torch.float32 else torch.int16).numpy()
    # torch compares with the threshold in A's dtype; past float32's range there are no outliers
    limit = float(torch.tensor(threshold, dtype=rows.dtype).float()) if threshold > 0.0 else float("inf")
    q = torch.empty(rows.shape, dtype=torch.int8)
    row_stats = torch.empty(rows.shape[0], dtype=torch.float32)
    outlier = torch.zeros(rows.shape[1], dtype=torch.uint8)
    bad = torch.zeros(rows.shape[0], dtype=torch.uint8)
    with kernel_lock:
        _row_kernels()[0](
            bits.view(np.uint32 if bits.itemsize == 4 else np.uint16),
            np.float32(limit),
            q.numpy(),
            row_stats.numpy(),
            outlier.numpy(),
            bad.numpy(),
        )
    if bool(bad.any()):
        return reference()
    outlier_cols = torch.argwhere(outlier).view(-1)
    if rows.shape[0] > 1 and outlier_cols.numel():
        q[:, outlier_cols] = 0
    return q, row_stats, outlier_cols


def mm_dequant_cpu(rows: torch.Tensor, row_stats, col_stats, scale: float, dtype, bias, reference):
    """``reference()``'s result for an int32 (rows, N) ``rows``, computed in float32 as it
    does (a float64 bias promotes the sum to float64: the reference's)."""
    if (bias is not None and bias.dtype == torch.float64) or usable_numba(
        "int8_mm_dequant", "running the reference kernel"
    ) is None:
        return reference()
    out = torch.empty(rows.shape, dtype=torch.float32)
    bias32 = torch.empty(0) if bias is None else bias.float().contiguous()
    with kernel_lock:
        _row_kernels()[1](
            rows.contiguous().numpy(),
            row_stats.contiguous().view(-1).numpy(),
            col_stats.contiguous().view(-1).numpy(),
            np.float32(scale),
            bias32.numpy(),
            out.numpy(),
        )
    return out.to(dtype)
