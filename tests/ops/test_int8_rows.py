"""int8_vectorwise_quant's and int8_mm_dequant's numba kernels: bit-equal to the reference
kernels (every 16-bit input, rounding to 16-bit outputs, one thread and several), the
reference where numba is missing or the input is not finite, and the memory the planner
counts for them."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.memory import allocated_peak
from tightfit.ops import _cpu_int8_rows
from tightfit.ops import int8 as int8_ops
from tightfit.quant import LinearInt8


@pytest.fixture(params=["native", "numba, one thread", "numba, parallel"])
def drivers(request, monkeypatch):
    """Every driver: the native port (small calls), numba's on one thread, or (where torch
    has two threads) numba's in one parallel region."""
    monkeypatch.setattr(_cpu_int8_rows, "PARALLEL_MIN", 0 if request.param == "numba, parallel" else 1 << 62)
    if request.param != "native":
        monkeypatch.setattr(_cpu_int8_rows, "_native_steps", lambda rows, cols: None)


def _equal(ours, theirs) -> None:
    for got, want in zip(ours, theirs, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threshold", [0.0, 1.01, 6.01, 1e300])
def test_vectorwise_quant_is_the_reference(drivers, dtype, threshold):
    A = (torch.randn(2, 37, 65, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    A[0, 0] = 0.0  # a zero row
    A[1, 3, 7] = 6.0  # on the threshold once rounded to bfloat16
    A[1, 4, :] = 9.0  # every entry an outlier
    _equal(int8_ops._vectorwise_cpu(A, threshold), int8_ops._vectorwise_reference(A, threshold))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_way_codes_round_as_the_reference_for_every_scale(drivers, dtype):
    """x = max / 2 is code 63.5 up to the scale's rounding: the kernel's scale must round as
    the reference's ``127.0 / row_stats`` does (127 times the float32 reciprocal; the
    correctly rounded quotient is an ulp off for some rows, e.g. max 120: the fuzz campaign
    found 4 such codes in 10,000 cases)."""
    largest = torch.arange(1, 2049, dtype=torch.float32)
    A = torch.stack([largest, -largest / 2, largest / 2, largest * 0.25], dim=1).to(dtype)
    _equal(int8_ops._vectorwise_cpu(A, 0.0), int8_ops._vectorwise_reference(A, 0.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_finite_16_bit_value_is_widened_exactly(drivers, dtype):
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    A = values[torch.isfinite(values)].reshape(-1, 1)  # one value a row: row_stats is |value|
    _equal(int8_ops._vectorwise_cpu(A, 0.0), int8_ops._vectorwise_reference(A, 0.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_goes_to_the_reference(bad):
    A = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    A[2, 5] = bad
    ours, theirs = int8_ops._vectorwise_cpu(A, 0.0), int8_ops._vectorwise_reference(A, 0.0)
    assert torch.equal(ours[0], theirs[0]) and torch.allclose(ours[1], theirs[1], equal_nan=True)
    with pytest.raises(ValueError, match="A has NaN or inf values"):
        tightfit.ops.int8_vectorwise_quant(A)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_mm_dequant_is_the_reference(drivers, dtype, bias_dtype):
    generator = torch.Generator().manual_seed(8)
    product = torch.randint(-(1 << 30), 1 << 30, (3, 5, 24), generator=generator, dtype=torch.int32)  # past 2**24
    row_stats, col_stats = torch.rand(15, generator=generator) * 9, torch.rand(24, generator=generator) * 9
    row_stats[:3] = torch.tensor([1e-20, 1e3, 3e-3])  # float16 zeros and subnormals, overflow to inf
    bias = None if bias_dtype is None else torch.randn(24, generator=generator).to(bias_dtype)
    expected = int8_ops._mm_dequant_reference(product, row_stats, col_stats, dtype, bias)
    ours = int8_ops._mm_dequant_cpu(product, row_stats, col_stats, dtype, bias)
    assert ours.dtype == expected.dtype and torch.equal(ours, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_to_16_bits_is_torch_s(drivers, dtype):
    """float32 values from random bit patterns, float16's edges (largest, halfway to inf,
    subnormals) and a dense range, each the product of 1 and scales of 1 and the value."""
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 16,), generator=torch.Generator().manual_seed(9))
    values = bits.to(torch.int32).view(torch.float32)
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-45, 0.0, 3e38])
    values = torch.cat([values[torch.isfinite(values)], edges, -edges, torch.arange(-70000.0, 70000.0, 3.7)])
    product, ones = torch.ones(1, values.numel(), dtype=torch.int32), torch.ones(1)
    ours = int8_ops._mm_dequant_cpu(product, ones, values, dtype, None)
    assert torch.equal(ours, (values * int8_ops.INV_127_SQUARED).to(dtype).reshape(1, -1))


def test_without_numba_the_reference_runs(monkeypatch):
    monkeypatch.setattr(_cpu_int8_rows, "usable_numba", lambda op, instead: None)
    monkeypatch.setattr(_cpu_int8_rows, "_kernels", None)  # called, it would fail
    A = torch.randn(5, 16)
    _equal(int8_ops._vectorwise_cpu(A, 1.0), int8_ops._vectorwise_reference(A, 1.0))
    product, row_stats, col_stats = torch.randint(-99, 99, (5, 16), dtype=torch.int32), torch.rand(5), torch.rand(16)
    expected = int8_ops._mm_dequant_reference(product, row_stats, col_stats, torch.float16, None)
    assert torch.equal(int8_ops._mm_dequant_cpu(product, row_stats, col_stats, torch.float16, None), expected)


@pytest.mark.parametrize("rows, cols, outlier_columns", [(48, 256, 0), (48, 256, 5), (7, 100, 3), (600, 512, 40)])
def test_vectorwise_peak_is_what_the_kernel_holds(rows, cols, outlier_columns):
    A = torch.randn(rows, cols, generator=torch.Generator().manual_seed(10)).clamp(-3, 3)
    A[::7, :outlier_columns] = 8.0
    with torch.inference_mode():
        peak = allocated_peak(lambda: tightfit.ops.int8_vectorwise_quant(A, 6.0))
    assert peak == _cpu_int8_rows.vectorwise_peak_bytes(rows, cols, outlier_columns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mm_dequant_allocates_its_output_only(dtype):
    product, row_stats, col_stats = torch.ones(48, 300, dtype=torch.int32), torch.rand(48), torch.rand(300)
    bias = torch.randn(300).to(dtype)
    with torch.inference_mode():
        peak = allocated_peak(lambda: tightfit.ops.int8_mm_dequant(product, row_stats, col_stats, dtype, bias))
    assert peak == 48 * 300 * dtype.itemsize


@pytest.mark.parametrize("outlier_columns", [0, 5])
def test_without_numba_the_prediction_covers_the_reference_kernels(monkeypatch, outlier_columns):
    monkeypatch.setattr(_cpu_int8_rows, "usable_numba", lambda op, instead: None)
    monkeypatch.setattr(_cpu_int8_rows, "load_numba", lambda: (None, "numba is not usable (test)"))
    layer = LinearInt8.from_linear(torch.nn.Linear(256, 512), threshold=6.0)
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(11)).clamp(-3, 3)
    x[::7, :outlier_columns] = 8.0
    with torch.inference_mode():
        peak = allocated_peak(lambda: layer(x))
    predicted = LinearInt8.transient_bytes((512, 256), 48, outlier_columns, torch.float32)
    assert 0 <= predicted - (peak - 48 * 512 * 4) <= 16 * 1024
