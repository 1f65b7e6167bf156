"""LLM.int8()-style ops: row-wise int8 quantization with an outlier threshold, int8
matmul into int32, and dequantization of the product, as bitsandbytes defines them.

An all-zero row has scale 0 and quantizes to zeros (bitsandbytes divides by zero there).
A row is the last dimension; every other dimension counts rows, so (3, 0) is three empty
rows and a scalar is refused.
"""

from __future__ import annotations

import math

import torch

from tightfit._validate import check_non_negative_number, check_same_device, check_type
from tightfit.ops._arg_checks import FLOAT_DTYPES, check_dtype
from tightfit.ops._cpu_int8 import linear_matmul_cpu
from tightfit.ops._cpu_int8_rows import mm_dequant_cpu, vectorwise_quant_cpu
from tightfit.ops._registry import Case, define_op, register_kernel

__all__ = ["int8_linear_matmul", "int8_mm_dequant", "int8_vectorwise_dequant", "int8_vectorwise_quant"]

#: 1 / 127**2 as bitsandbytes writes it; multiplying by it (not dividing) keeps results bit-identical.
INV_127_SQUARED = 6.200124e-05


def _row_count(A: torch.Tensor) -> int:
    return math.prod(A.shape[:-1])


def _rows(A: torch.Tensor) -> torch.Tensor:
    """A as a (rows, last dimension) matrix; explicit sizes, since -1 is ambiguous for zero width."""
    return A.reshape(_row_count(A), A.shape[-1])


def _vectorwise_reference(A: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = _rows(A)
    outlier_cols = torch.empty(0, dtype=torch.int64, device=A.device)
    if threshold > 0.0:
        outliers = rows.abs() >= threshold
        outlier_cols = torch.argwhere(outliers.any(dim=0)).view(-1)
        rows = rows.masked_fill(outliers, 0)
    row_stats = rows.abs().amax(dim=1).float() if rows.numel() else torch.zeros(rows.shape[0], device=A.device)
    scale = torch.where(row_stats > 0, 127.0 / row_stats, torch.zeros_like(row_stats))
    q = torch.round(rows * scale.unsqueeze(-1)).to(torch.int8)
    if rows.shape[0] > 1 and outlier_cols.numel():
        q[:, outlier_cols] = 0
    return q.reshape(A.shape), row_stats, outlier_cols


def _vectorwise_cpu(A: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One numba pass per row (see _cpu_int8_rows); the reference's bits."""
    if A.numel() == 0:
        return _vectorwise_reference(A, threshold)
    q, row_stats, cols = vectorwise_quant_cpu(_rows(A), threshold, lambda: _vectorwise_reference(A, threshold))
    return q.reshape(A.shape), row_stats, cols


def _vectorwise_fake(A, threshold):
    ctx = torch.library.get_ctx()
    cols = ctx.new_dynamic_size()
    return (
        torch.empty(A.shape, dtype=torch.int8, device=A.device),
        torch.empty(_row_count(A), device=A.device),
        torch.empty(cols, dtype=torch.int64, device=A.device),
    )


def _linear_matmul_reference(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return (_rows(A).to(torch.int32) @ B.to(torch.int32).t()).reshape(*A.shape[:-1], B.shape[0])


def _linear_matmul_fake(A, B):
    return torch.empty(*A.shape[:-1], B.shape[0], dtype=torch.int32, device=A.device)


def _linear_matmul_cpu(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Exact like the reference (int32 accumulation), at float GEMM speed (see _cpu_int8)."""
    rows = _rows(A)
    if rows.shape[0] == 0 or rows.shape[1] == 0 or B.shape[0] == 0:
        return _linear_matmul_reference(A, B)
    return linear_matmul_cpu(rows, B).reshape(*A.shape[:-1], B.shape[0])


#: torch._int_mm's shape rule on CUDA (cuBLASLt int8): more rows than this, and K and N multiples of ``_INT_MM_ALIGN``.
_INT_MM_MIN_ROWS = 17
_INT_MM_ALIGN = 8


def _linear_matmul_int_mm(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm`` (int32 accumulation: exact, as the reference) on shapes it refuses
    made acceptable: rows padded to 17 and K, N to multiples of 8 with zeros, which add
    nothing to any product; the padding is cut off the result. (The reference's int32
    matmul has no CUDA kernel.)"""
    rows = _rows(A)
    M, K = rows.shape
    N = B.shape[0]
    if M == 0 or K == 0 or N == 0:
        return torch.zeros(*A.shape[:-1], N, dtype=torch.int32, device=A.device)
    pad_k = -K % _INT_MM_ALIGN
    pad_m = max(_INT_MM_MIN_ROWS - M, 0)
    pad_n = -N % _INT_MM_ALIGN
    if pad_k or pad_m:
        rows = torch.nn.functional.pad(rows, (0, pad_k, 0, pad_m))
    weight = torch.nn.functional.pad(B, (0, pad_k, 0, pad_n)) if pad_k or pad_n else B.contiguous()
    product = torch._int_mm(rows.contiguous(), weight.t())
    return product[:M, :N].reshape(*A.shape[:-1], N)


def _mm_dequant_reference(
    A: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = _rows(A)
    out = rows * (row_stats.reshape(-1, 1) * col_stats.reshape(1, -1)) * INV_127_SQUARED
    if bias is not None:
        out = out + bias
    return out.to(dtype).reshape(A.shape)


def _mm_dequant_cpu(
    A: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None
) -> torch.Tensor:
    """One numba pass over the product (see _cpu_int8_rows); the reference's bits."""
    if A.numel() == 0:
        return _mm_dequant_reference(A, row_stats, col_stats, dtype, bias)

    def reference() -> torch.Tensor:
        return _mm_dequant_reference(A, row_stats, col_stats, dtype, bias)

    return mm_dequant_cpu(_rows(A), row_stats, col_stats, INV_127_SQUARED, dtype, bias, reference).reshape(A.shape)


def _mm_dequant_fake(A, row_stats, col_stats, dtype, bias):
    return torch.empty(A.shape, dtype=dtype, device=A.device)


def _cases_vectorwise() -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    A = torch.randn(33, 64, generator=generator)
    A[3, 7] = 20.0
    return [
        Case(f"{dtype} t={t}", (A.to(dtype), t))
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for t in (0.0, 6.0)
    ] + [
        Case("zero row", (torch.cat([A[:2], torch.zeros(1, 64)]), 0.0)),
        # 6.01 is 6.0 in bfloat16: the threshold is compared in A's dtype
        Case("bfloat16 on the threshold", (torch.full((3, 8), 6.0, dtype=torch.bfloat16), 6.01)),
        Case("float16 subnormals", (torch.tensor([[1e-7, -3e-6, 6e-5, 0.0]], dtype=torch.float16), 0.0)),
        Case("parallel rows", (torch.randn(512, 512, generator=generator) * 4, 6.0)),  # past PARALLEL_MIN
    ]


def _cases_matmul() -> list[Case]:
    generator = torch.Generator().manual_seed(1)

    def ints(*shape):
        return torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)

    def extremes(*shape):
        return torch.where(torch.rand(shape, generator=generator) < 0.5, -128, 127).to(torch.int8)

    return [
        Case("17x64 @ 48x64", (ints(17, 64), ints(48, 64))),
        Case("one token", (ints(1, 1, 4096), ints(8, 4096))),
        Case("32 rows, extremes", (torch.full((32, 300), -128, dtype=torch.int8), ints(40, 300))),
        # K runs past 1024, N past one block of B; sums past 2**24, which float32 alone would round
        Case(
            "extremes, K 2100, N 300",
            (torch.full((40, 2100), -128, dtype=torch.int8), torch.full((300, 2100), -128, dtype=torch.int8)),
        ),
        Case("mixed extremes, K 1100", (extremes(33, 1100), extremes(257, 1100))),
        Case("empty", (ints(0, 64), ints(8, 64))),
        Case("zero width", (ints(3, 0), ints(8, 0))),
    ]


def _cases_dequant() -> list[Case]:
    generator = torch.Generator().manual_seed(2)
    A = torch.randint(-(1 << 20), 1 << 20, (9, 12), generator=generator, dtype=torch.int32)
    return [
        Case(
            f"{dtype} bias={b}",
            (
                A,
                torch.rand(9, generator=generator) * 5,
                torch.rand(12, generator=generator) * 5,
                dtype,
                torch.randn(12, generator=generator) if b else None,
            ),
        )
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
        for b in (False, True)
    ] + [
        # float16's subnormals and overflow to inf, a bias in the output's dtype
        Case(
            "float16 range",
            (
                A,
                torch.tensor([1e-9, 1e-6, 1e-3, 1.0, 10.0, 1e3, 1e4, 1e5, 1e6]),
                torch.rand(12, generator=generator) * 5,
            )
            + (torch.float16, torch.randn(12, generator=generator).half()),
        ),
        Case(
            "parallel rows",  # past PARALLEL_MIN
            (
                torch.randint(-(1 << 24), 1 << 24, (512, 512), generator=generator, dtype=torch.int32),
                torch.rand(512, generator=generator),
                torch.rand(512, generator=generator),
                torch.bfloat16,
                torch.randn(512, generator=generator).bfloat16(),
            ),
        ),
    ]


# -- checks (D9): what every kernel relies on, run inside the op on every path --------------


def _check_int_tensor(name: str, tensor: object, dtype: torch.dtype) -> torch.Tensor:
    check_type(name, tensor, torch.Tensor)
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must be {str(dtype).removeprefix('torch.')}, got dtype {tensor.dtype}")
    if tensor.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (rows x features), got a scalar")
    return tensor


def _check_vectorwise(A: object, threshold: object) -> None:
    check_type("A", A, torch.Tensor)
    if A.dtype not in FLOAT_DTYPES:
        raise TypeError(f"A has dtype {A.dtype}; accepted: float32, float16, bfloat16")
    if A.dim() < 1:
        raise ValueError("A must have at least one dimension (rows x features), got a scalar")
    check_non_negative_number("threshold", threshold)


def _check_matmul(A: object, B: object) -> None:
    _check_int_tensor("A", A, torch.int8)
    _check_int_tensor("B", B, torch.int8)
    if B.dim() != 2 or A.shape[-1] != B.shape[1]:
        raise ValueError(f"shapes do not match for A @ B.T: A {tuple(A.shape)}, B {tuple(B.shape)} (B must be N x K)")
    check_same_device("B", B, "A", A)


#: float8 has no type promotion with the float32 product.
_BIAS_DTYPES = (*FLOAT_DTYPES, torch.float64)


def _check_dequant(A: object, row_stats: object, col_stats: object, dtype: object, bias: object) -> None:
    _check_int_tensor("A", A, torch.int32)
    for name, stats, expected in (("row_stats", row_stats, _row_count(A)), ("col_stats", col_stats, A.shape[-1])):
        check_type(name, stats, torch.Tensor)
        if stats.dtype != torch.float32 or stats.numel() != expected:
            raise ValueError(f"{name} must be float32 with {expected} values, got {stats.dtype} with {stats.numel()}")
        check_same_device(name, stats, "A", A)
    check_dtype("dtype", dtype)
    if bias is not None:
        check_type("bias", bias, torch.Tensor)
        if bias.shape != (A.shape[-1],) or bias.dtype not in _BIAS_DTYPES:
            raise ValueError(
                f"bias must be a float32, float16, bfloat16 or float64 tensor of shape ({A.shape[-1]},), "
                f"got {bias.dtype} {tuple(bias.shape)}"
            )
        check_same_device("bias", bias, "A", A)


_VECTORWISE = define_op(
    "int8_vectorwise_quant",
    _vectorwise_reference,
    fake=_vectorwise_fake,
    cases=_cases_vectorwise,
    check=_check_vectorwise,
)
_MATMUL = define_op(
    "int8_linear_matmul", _linear_matmul_reference, fake=_linear_matmul_fake, cases=_cases_matmul, check=_check_matmul
)
_DEQUANT = define_op(
    "int8_mm_dequant", _mm_dequant_reference, fake=_mm_dequant_fake, cases=_cases_dequant, check=_check_dequant
)
register_kernel("int8_linear_matmul", "cpu", _linear_matmul_cpu, label="exact float GEMMs / numba")
register_kernel("int8_vectorwise_quant", "cpu", _vectorwise_cpu, label="numba, a pass per row")
register_kernel("int8_mm_dequant", "cpu", _mm_dequant_cpu, label="numba, a pass per row")
register_kernel("int8_linear_matmul", "cuda", _linear_matmul_int_mm, label="torch._int_mm (cuBLASLt), padded")
# The references are elementwise torch, as fast on a GPU as a kernel of ours would be: named
# kernels there, so that using them is not reported as a fallback.
register_kernel("int8_vectorwise_quant", "cuda", _vectorwise_reference, label="pure torch on the device")
register_kernel("int8_mm_dequant", "cuda", _mm_dequant_reference, label="pure torch on the device")


#: What int8 quantization says of NaN or inf in its input.
NON_FINITE = "A has NaN or inf values; int8 quantization needs finite values"


def _check_finite(A: torch.Tensor) -> None:
    """ValueError where ``A`` holds NaN or inf (a pass of its own over ``A``)."""
    if A.numel() and not _all_finite(A):
        raise ValueError(NON_FINITE)


def _all_finite(A: torch.Tensor) -> bool:
    """Whether ``A`` holds no NaN or inf: its min and max in one pass (NaN propagates into
    both), without the full-size boolean mask ``isfinite`` builds, which cost more than the op."""
    low, high = torch.aminmax(A)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def int8_vectorwise_quant(
    A: torch.Tensor, threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row-wise int8: (q, row_stats, outlier_cols). With ``threshold`` > 0, entries with
    |A| >= threshold are left out of the scales and their columns zeroed in ``q``
    (``outlier_cols`` lists them; None when ``threshold`` is 0). ``A`` is not modified."""
    threshold = check_non_negative_number("threshold", threshold)
    _check_vectorwise(A, threshold)
    if not torch.compiler.is_compiling():
        _check_finite(A)
    q, row_stats, cols = _VECTORWISE(A, float(threshold))
    return q, row_stats, (cols if threshold > 0.0 else None)


def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """float32 ``A * stats / 127`` per row: the inverse of :func:`int8_vectorwise_quant`."""
    _check_int_tensor("A", A, torch.int8)
    check_type("stats", stats, torch.Tensor)
    if stats.numel() != _row_count(A):
        raise ValueError(f"stats has {stats.numel()} values; A has {_row_count(A)} rows")
    check_same_device("stats", stats, "A", A)
    return A.float() * (stats.reshape(-1, 1).float() / 127.0).reshape(*A.shape[:-1], 1)


def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A @ B.T`` for int8 ``A`` (..., K) and ``B`` (N, K), exact, as int32."""
    return _MATMUL(A, B)


def int8_mm_dequant(
    A: torch.Tensor,
    row_stats: torch.Tensor,
    col_stats: torch.Tensor,
    dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale an int32 product back: ``A * row_stats * col_stats / 127**2`` (+ bias), as ``dtype`` (default float16)."""
    return _DEQUANT(A, row_stats, col_stats, torch.float16 if dtype is None else dtype, bias)
