"""The CPU int8 matmul: exact (int32) on each of its paths, and bitsandbytes' answers where it has one."""

from __future__ import annotations

import pytest
import torch

import tightfit.ops as ops
from tightfit.ops import _cpu_int8


def _ints(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def _exact(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return (A.long() @ B.long().t()).to(torch.int32)


def _float32_breaker() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose sum passes 2**24 and then adds ones: float32 rounds them away, int32 keeps them."""
    row = torch.cat([torch.full((1030,), -128, dtype=torch.int8), torch.ones(11, dtype=torch.int8)])
    return row.repeat(20, 1), row.repeat(3, 1)


@pytest.mark.parametrize("rows", [1, 3, _cpu_int8.FEW_ROWS, _cpu_int8.FEW_ROWS + 1, 64])
@pytest.mark.parametrize("K", [1, 7, 300])
def test_every_row_count_is_exact(rows: int, K: int) -> None:
    A, B = _ints(rows, K), _ints(24, K, seed=1)
    A[0] = -128
    assert torch.equal(ops.int8_linear_matmul(A, B), _exact(A, B))


def test_sums_past_float32_stay_exact() -> None:
    A, B = _float32_breaker()
    assert torch.equal(ops.int8_linear_matmul(A, B), _exact(A, B))
    assert torch.equal(ops.int8_linear_matmul(A[:2], B), _exact(A[:2], B))


def test_float32_bound() -> None:
    """Row-wise quantized normal data of width 4096 passes the L1 bound (one float32 GEMM);
    the breaker does not."""
    A, _, _ = ops.int8_vectorwise_quant(torch.randn(32, 4096, generator=torch.Generator().manual_seed(3)))
    B, _, _ = ops.int8_vectorwise_quant(torch.randn(8, 4096, generator=torch.Generator().manual_seed(4)))
    assert _cpu_int8._fits_float32(A, B, A.float())
    assert torch.equal(ops.int8_linear_matmul(A, B), _exact(A, B))
    A, B = _float32_breaker()
    assert not _cpu_int8._fits_float32(A, B, A.float())


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_relaxed_float32_precision_stays_exact(precision: str) -> None:
    A, B = _ints(40, 700), _ints(30, 700, seed=1)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert not _cpu_int8._float32_is_ieee()
        assert torch.equal(ops.int8_linear_matmul(A, B), _exact(A, B))
    finally:
        torch.set_float32_matmul_precision(before)


def test_without_numba_few_rows_use_int_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_int8, "usable_numba", lambda op, instead: None)
    A, B = _ints(2, 64), _ints(8, 64, seed=1)
    assert torch.equal(_cpu_int8.linear_matmul_cpu(A, B), _exact(A, B))


def test_avx512_uses_int_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    A, B = _ints(20, 64), _ints(8, 64, seed=1)
    assert torch.equal(_cpu_int8.linear_matmul_cpu(A, B), _exact(A, B))


@pytest.mark.parametrize("rows", [2, 40])
def test_strided_inputs(rows: int) -> None:
    A = _ints(2 * rows, 96)[::2, 5:69]
    B = _ints(64, 12, seed=1).t()  # (12, 64), column-major
    assert torch.equal(ops.int8_linear_matmul(A, B), _exact(A, B))


def test_batched_rows_keep_their_shape() -> None:
    A, B = _ints(2, 3, 50), _ints(7, 50, seed=1)
    out = ops.int8_linear_matmul(A, B)
    assert out.shape == (2, 3, 7)
    assert torch.equal(out.reshape(6, 7), _exact(A.reshape(6, 50), B))


# -- against bitsandbytes (a test extra) ---------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 64, 16), (17, 499, 24), (64, 4096, 8)])
def test_matmul_matches_bitsandbytes(shape: tuple[int, int, int]) -> None:
    bnb = pytest.importorskip("bitsandbytes.functional")
    M, K, N = shape
    A, B = _ints(M, K), _ints(N, K, seed=1)
    assert torch.equal(ops.int8_linear_matmul(A, B), bnb.int8_linear_matmul(A, B))


def test_outlier_columns_and_dequant_dtype_as_bitsandbytes() -> None:
    bnb = pytest.importorskip("bitsandbytes.functional")
    A = torch.randn(6, 32, generator=torch.Generator().manual_seed(5))
    for threshold in (0.0, 6.0):
        ours, theirs = ops.int8_vectorwise_quant(A, threshold)[2], bnb.int8_vectorwise_quant(A.clone(), threshold)[2]
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert torch.equal(ours, theirs)
    product = _ints(6, 32).int() * 1000
    row_stats, col_stats = torch.rand(6) * 3, torch.rand(32) * 3
    ours = ops.int8_mm_dequant(product, row_stats, col_stats)
    theirs = bnb.int8_mm_dequant(product, row_stats, col_stats)
    assert ours.dtype == theirs.dtype == torch.float16
    assert torch.equal(ours, theirs)
