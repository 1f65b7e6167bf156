"""int8_linear_matmul's CPU paths: each bit-equal to the int32 reference (extremes and sums
past 2**24 included), its scratch as declared, and against bitsandbytes' CPU result."""

from __future__ import annotations

import pytest
import torch

import tightfit.ops as ops
from tightfit.memory import allocated_peak
from tightfit.ops import _cpu_int8

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "AVX512", reason="AVX-512 takes torch._int_mm, as bitsandbytes"
)

# rows x K x N: one K run and several; one block of B and several (BLOCK_BYTES / (4 * run) rows each)
SHAPES = [(33, 7, 5), (40, 1024, 300), (48, 2100, 300), (70, 1025, 1100)]


def _ints(kind: str, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    if kind == "random":
        return torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
    if kind == "-128":
        return torch.full(shape, -128, dtype=torch.int8)
    return torch.where(torch.rand(shape, generator=generator) < 0.5, -128, 127).to(torch.int8)


def _reference(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return A.to(torch.int32) @ B.to(torch.int32).t()


@pytest.mark.parametrize("rows, K, N", SHAPES)
@pytest.mark.parametrize("kind", ["random", "-128", "mixed"])
def test_float_gemm_path_is_exact(rows, K, N, kind):
    assert _cpu_int8._path(rows) == "float"
    A, B = _ints(kind, rows, K), _ints(kind, N, K)
    expected = _reference(A, B)
    assert torch.equal(ops.int8_linear_matmul(A, B), expected)
    assert torch.equal(ops.int8_linear_matmul(A.t().contiguous().t(), B.t().contiguous().t()), expected)


def test_float_gemm_path_sums_past_float32():
    A, B = _ints("-128", 40, 2100), _ints("-128", 3, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), torch.full((40, 3), 2100 * 128 * 128, dtype=torch.int32))


@pytest.mark.parametrize("rows", [1, 5, _cpu_int8.FEW_ROWS])
@pytest.mark.parametrize("kind", ["random", "-128", "mixed"])
def test_few_rows_path_is_exact(rows, kind):
    assert _cpu_int8._path(rows) == "few_rows"
    A, B = _ints(kind, 1, rows, 2100), _ints(kind, 37, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A[0], B).unsqueeze(0))


def test_int32_accumulation_wraps_as_the_reference():
    A, B = _ints("-128", 33, 140_000), _ints("-128", 2, 140_000)  # 140000 * 2**14 passes 2**31
    expected = _reference(A, B)
    assert torch.equal(ops.int8_linear_matmul(A, B), expected)
    assert torch.equal(ops.int8_linear_matmul(A[:1], B), expected[:1])


def test_rounding_float32_gemms_take_int_mm(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16")
    assert _cpu_int8._path(64) == "int_mm" and _cpu_int8.scratch_bytes(64, 300, 2100) == 0
    A, B = _ints("mixed", 64, 2100), _ints("mixed", 300, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B))


def test_few_rows_without_numba_take_int_mm(monkeypatch):
    monkeypatch.setattr(_cpu_int8, "usable_numba", lambda op, instead: None)
    A, B = _ints("mixed", 3, 2100), _ints("mixed", 37, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B))


@pytest.mark.parametrize("rows, K, N", [*SHAPES, (8, 2100, 300)])
def test_scratch_is_what_the_kernel_allocates(rows, K, N):
    A, B = _ints("random", rows, K), _ints("random", N, K)
    with torch.inference_mode():
        peak = allocated_peak(lambda: ops.int8_linear_matmul(A, B))
    assert peak == 4 * rows * N + _cpu_int8.scratch_bytes(rows, N, K)
    assert _cpu_int8.scratch_bytes(rows, N, K) <= 4 * rows * min(K, 1024) + _cpu_int8.BLOCK_BYTES + 4 * rows * N


def _bitsandbytes_matmul():
    pytest.importorskip("bitsandbytes")
    return torch.ops.bitsandbytes.int8_linear_matmul.default


@pytest.mark.parametrize("rows, K, N", [(1, 512, 64), SHAPES[1], SHAPES[3]])
def test_same_as_bitsandbytes_where_its_float32_sums_are_exact(rows, K, N):
    A, B = _ints("random", rows, K), _ints("random", N, K)
    assert torch.equal(ops.int8_linear_matmul(A, B), _bitsandbytes_matmul()(A, B))


def test_exact_where_bitsandbytes_rounds():
    A = _ints("-128", 40, 2100)
    B = _ints("-128", 3, 2100)
    A[:, 0] = B[:, 0] = 1  # the sum 2099 * 2**14 + 1 is past 2**24 and odd: float32 cannot hold it
    expected = _reference(A, B)
    assert torch.equal(ops.int8_linear_matmul(A, B), expected)
    assert not torch.equal(_bitsandbytes_matmul()(A, B), expected)
