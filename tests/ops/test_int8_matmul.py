"""int8_linear_matmul's CPU paths: each pinned in turn, whatever this CPU has, and each
bit-equal to the int32 reference on every shape (K = 1, extremes and sums past 2**24
included), its scratch as declared, and against bitsandbytes' CPU result. The native
path is tested on every instruction set this CPU runs (TIGHTFIT_CPU_KERNEL_PATH)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit
import tightfit.ops as ops
from tightfit import FallbackWarning, StrictModeError
from tightfit.memory import allocated_peak
from tightfit.ops import _cpu_int8, _native

# rows x K x N: one K run and several; one block of B and several (BLOCK_BYTES / (4 * run) rows each)
SHAPES = [(33, 7, 5), (40, 1024, 300), (48, 2100, 300), (70, 1025, 1100)]
#: Shapes torch._int_mm got wrong on an AVX-512 CPU (K = 1, N > 1), and other edges.
EDGE_SHAPES = [(3, 1, 8), (1, 1, 2), (40, 1, 300), (1, 1, 1), (1, 2100, 1), (2, 3, 1), (1, 64, 37)]


@pytest.fixture(params=_cpu_int8.PATHS)
def path(request, monkeypatch):
    """Each CPU path pinned in turn (TIGHTFIT_CPU_INT8_PATH), so one machine tests them all."""
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, request.param)
    return request.param


def _ints(kind: str, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    if kind == "random":
        return torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
    if kind == "-128":
        return torch.full(shape, -128, dtype=torch.int8)
    return torch.where(torch.rand(shape, generator=generator) < 0.5, -128, 127).to(torch.int8)


def _reference(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return A.to(torch.int32) @ B.to(torch.int32).t()


@pytest.mark.parametrize("rows, K, N", SHAPES + EDGE_SHAPES)
@pytest.mark.parametrize("kind", ["random", "-128", "mixed"])
def test_every_path_is_exact(path, rows, K, N, kind):
    assert _cpu_int8._path(rows) == path
    A, B = _ints(kind, rows, K), _ints(kind, N, K)
    expected = _reference(A, B)
    assert torch.equal(ops.int8_linear_matmul(A, B), expected)
    assert torch.equal(ops.int8_linear_matmul(A.t().contiguous().t(), B.t().contiguous().t()), expected)
    assert torch.equal(torch.ops.tightfit.int8_linear_matmul(A.unsqueeze(0), B), expected.unsqueeze(0))


@settings(max_examples=40, deadline=None)
@given(
    path=st.sampled_from(_cpu_int8.PATHS),
    rows=st.integers(1, 40),
    K=st.one_of(st.just(1), st.integers(1, 1100)),
    N=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_path_is_exact_on_generated_shapes(path, rows, K, N, seed):
    generator = torch.Generator().manual_seed(seed)
    A = torch.randint(-128, 128, (rows, K), generator=generator, dtype=torch.int8)
    B = torch.randint(-128, 128, (N, K), generator=generator, dtype=torch.int8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_cpu_int8.PATH_VARIABLE, path)
        assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B))


def test_sums_past_float32_on_every_path(path):
    A, B = _ints("-128", 40, 2100), _ints("-128", 3, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), torch.full((40, 3), 2100 * 128 * 128, dtype=torch.int32))


@pytest.mark.parametrize("rows", [1, 5, _cpu_int8.FEW_ROWS])
@pytest.mark.parametrize("kind", ["random", "-128", "mixed"])
def test_few_rows_on_every_path(path, rows, kind):
    A, B = _ints(kind, 1, rows, 2100), _ints(kind, 37, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A[0], B).unsqueeze(0))


def test_int32_accumulation_wraps_as_the_reference(path):
    A, B = _ints("-128", 33, 140_000), _ints("-128", 2, 140_000)  # 140000 * 2**14 passes 2**31
    expected = _reference(A, B)
    assert torch.equal(ops.int8_linear_matmul(A, B), expected)
    assert torch.equal(ops.int8_linear_matmul(A[:1], B), expected[:1])


def test_unpinned_choice_follows_the_cpu(monkeypatch):
    monkeypatch.delenv(_cpu_int8.PATH_VARIABLE, raising=False)
    rows = (1, _cpu_int8.NATIVE_ROWS, _cpu_int8.NATIVE_ROWS + 1, _cpu_int8.FEW_ROWS, _cpu_int8.FEW_ROWS + 1)
    for capability, expected in [
        ("AVX512", ("native", "native", "int_mm", "int_mm", "int_mm")),
        ("AVX2", ("native", "native", "few_rows", "few_rows", "float")),
    ]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        monkeypatch.setenv(_native.PATH_VARIABLE, "portable")  # the AVX2 cap would otherwise cap the native path too
        assert tuple(_cpu_int8._path(r) for r in rows) == expected
        monkeypatch.setenv(_native.PATH_VARIABLE, "none")  # no native kernels: as before they came
        assert tuple(_cpu_int8._path(r) for r in rows) == tuple(
            p if p != "native" else ("int_mm" if capability == "AVX512" else "few_rows") for p in expected
        )


def test_an_inexact_int_mm_is_never_taken(monkeypatch):
    """Where the probe finds torch._int_mm wrong (oneDNN without VNNI, for one), even a pin
    to it takes an exact path."""
    monkeypatch.setattr(_cpu_int8, "int_mm_is_exact", lambda: False)
    monkeypatch.setattr(torch, "_int_mm", lambda *args: pytest.fail("took the inexact torch._int_mm"))
    for pin in ("auto", *_cpu_int8.PATHS):
        monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, pin)
        assert "int_mm" not in (_cpu_int8._path(1), _cpu_int8._path(64))
        if pin in ("auto", "int_mm"):
            assert (_cpu_int8._path(1), _cpu_int8._path(64)) == ("native", "float")
        A, B = _ints("mixed", 64, 300), _ints("random", 9, 300)
        assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B))


def test_native_without_a_build_takes_numba_with_a_warning(monkeypatch):
    """No compiler (or a failed build): a pin to ``native`` says so once (D1) and the few-row
    product runs the numba kernel, still exact; strict mode refuses."""
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "native")
    monkeypatch.setattr(_native, "library", lambda: (None, "no C compiler (test)"))
    A, B = _ints("mixed", 3, 2100), _ints("mixed", 37, 2100)
    with pytest.warns(FallbackWarning, match="int8_linear_matmul.*no C compiler"):
        assert _cpu_int8._path(3) == "few_rows"
    assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B))
    with tightfit.strict(), pytest.raises(StrictModeError, match="no C compiler"):
        ops.int8_linear_matmul(A, B)
    monkeypatch.setenv(_native.PATH_VARIABLE, "none")  # asked for no native kernels: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cpu_int8._path(3) == "few_rows"


#: Each instruction set the native kernel is built for (this CPU permitting), the AVX-512
#: ones with and without VNNI (taken only where the CPU has it).
KERNELS = [
    (path, vnni)
    for path in _native.PATHS
    if _native.runnable(path)
    for vnni in (True, False)[: 2 if "512" in path else 1]
]


@pytest.mark.parametrize(("kernel_path", "vnni"), KERNELS)
@pytest.mark.parametrize("rows", [1, 9, 33])  # one token, a group of 8 and one more, many
@pytest.mark.parametrize("K", [1, 16, 17, 65, 1025])  # around the vector widths
def test_native_kernel_on_every_instruction_set_is_exact(monkeypatch, kernel_path, vnni, rows, K):
    """On widths around its vector steps (16, 32 and 64 bytes) and row counts around its groups of 8."""
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "native")
    monkeypatch.setenv(_native.PATH_VARIABLE, kernel_path)
    monkeypatch.setattr(_native, "VNNI", vnni)
    for kind in ("random", "-128", "mixed"):
        A, B = _ints(kind, rows, K), _ints(kind, 37, K)
        A[0, 0], B[0, -1] = 127, -128
        assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B)), kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_few_rows_in_one_native_call_keep_the_references_bits(monkeypatch, dtype, bias_dtype):
    """Without outliers, up to 8 rows run quantize, product and dequantize in one native
    call (_cpu_int8_rows.linear_rows); the result is the reference's, bit for bit."""
    from tightfit.ops import _cpu_int8_rows

    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "native")
    calls = []
    fused = _cpu_int8_rows.linear_rows
    monkeypatch.setattr(_cpu_int8_rows, "linear_rows", lambda *args: calls.append(fused(*args)) or calls[-1])
    generator = torch.Generator().manual_seed(3)
    for rows in (1, 8):
        A = (torch.randn(rows, 70, generator=generator) * 2).clamp(-5.9, 5.9).to(dtype)  # no outliers
        weight = torch.randint(-127, 128, (41, 70), generator=generator, dtype=torch.int8)
        SCB = torch.rand(41, generator=generator) * 3 + 0.1
        bias = None if bias_dtype is None else torch.randn(41, generator=generator).to(bias_dtype)
        got = ops.int8_linear(A, weight, SCB, bias, 6.0)
        want = ops.get_op("int8_linear").reference(A, weight, SCB, bias, 6.0)
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert len(calls) == 2 and all(result is not None for result in calls)  # the one call ran
    A[0, 5] = float("nan")
    with pytest.raises(ValueError, match="A has NaN or inf values"):
        ops.int8_linear(A, weight, SCB, bias, 6.0)


@pytest.mark.parametrize(("kernel_path", "vnni"), KERNELS)
@pytest.mark.parametrize("rows", [1, 8])
def test_outlier_columns_taken_in_the_products_pass_keep_the_references_bits(monkeypatch, kernel_path, vnni, rows):
    """LLM.int8() with outliers: the native kernel copies the weight's outlier columns while
    it streams each row; the layer's result stays the reference's, bit for bit."""
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "native")
    monkeypatch.setenv(_native.PATH_VARIABLE, kernel_path)
    monkeypatch.setattr(_native, "VNNI", vnni)
    generator = torch.Generator().manual_seed(rows)
    A = torch.randn(rows, 65, generator=generator).to(torch.bfloat16)
    A[0, [0, 17, 64]] = torch.tensor([9.0, -7.5, 12.0], dtype=torch.bfloat16)  # columns past 6.0, the last one
    weight = torch.randint(-127, 128, (37, 65), generator=generator, dtype=torch.int8)
    SCB = torch.rand(37, generator=generator) + 0.5
    got = ops.int8_linear(A, weight, SCB, None, 6.0)
    want = ops.get_op("int8_linear").reference(A, weight, SCB, None, 6.0)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("kernel_path", "vnni"), KERNELS)
def test_native_kernel_wraps_as_the_reference(monkeypatch, kernel_path, vnni):
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "native")
    monkeypatch.setenv(_native.PATH_VARIABLE, kernel_path)
    monkeypatch.setattr(_native, "VNNI", vnni)
    A, B = _ints("-128", 9, 140_001), _ints("-128", 3, 140_001)
    expected = _reference(A, B)
    assert expected[0, 0] < 0  # wrapped
    assert torch.equal(ops.int8_linear_matmul(A, B), expected)


def test_the_probe_sees_a_saturating_gemm():
    """oneDNN capped below VNNI saturates 16-bit pair sums: the probe says so, in a fresh process."""
    code = "from tightfit.ops import _cpu_int8; print(_cpu_int8.int_mm_is_exact())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if out.stdout.strip() == "True":  # this torch (or CPU) keeps exact sums whatever the cap
        pytest.skip("torch._int_mm stays exact under ONEDNN_MAX_CPU_ISA=AVX2 here")
    assert out.stdout.strip() == "False"


def test_an_unknown_pin_is_refused(monkeypatch):
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "avx9000")
    with pytest.raises(ValueError, match="TIGHTFIT_CPU_INT8_PATH='avx9000' is not a path; expected auto, int_mm"):
        ops.int8_linear_matmul(_ints("random", 2, 3), _ints("random", 4, 3))


def test_rounding_float32_gemms_take_int_mm(monkeypatch):
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "float")
    monkeypatch.setattr(torch.backends.mkldnn.matmul, "fp32_precision", "bf16")
    assert _cpu_int8._path(64) == "int_mm" and _cpu_int8.scratch_bytes(64, 300, 2100) == 0
    A, B = _ints("mixed", 64, 2100), _ints("mixed", 300, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B))


@pytest.mark.parametrize("int_mm_exact", [True, False])
def test_few_rows_without_numba_stay_exact(monkeypatch, int_mm_exact):
    monkeypatch.setenv(_cpu_int8.PATH_VARIABLE, "few_rows")
    monkeypatch.setattr(_cpu_int8, "usable_numba", lambda op, instead: None)
    monkeypatch.setattr(_cpu_int8, "int_mm_is_exact", lambda: int_mm_exact)
    A, B = _ints("mixed", 3, 2100), _ints("mixed", 37, 2100)
    assert torch.equal(ops.int8_linear_matmul(A, B), _reference(A, B))


@pytest.mark.parametrize("rows, K, N", [*SHAPES, (8, 2100, 300)])
def test_scratch_is_what_the_kernel_allocates(path, rows, K, N):
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
    theirs = _bitsandbytes_matmul()(A, B)
    if not _bitsandbytes_takes_int_mm():  # its float32 GEMM path rounds the sum
        assert not torch.equal(theirs, expected)


def test_exact_where_bitsandbytes_int_mm_misreads_k_1():
    """bitsandbytes passes B.t() of shape (1, N) to torch._int_mm, which reads it with the
    wrong strides on AVX-512 CPUs; tightfit's K = 1 is an outer product."""
    A, B = _ints("random", 3, 1), _ints("random", 8, 1)
    expected = _reference(A, B)
    assert torch.equal(ops.int8_linear_matmul(A, B), expected)
    if _bitsandbytes_takes_int_mm() and _cpu_int8.int_mm_is_exact():
        differing = int((_bitsandbytes_matmul()(A, B) != expected).sum())
        if differing:
            pytest.xfail(f"bitsandbytes' CPU int8_linear_matmul: {differing} of 24 values wrong at K = 1 here")


def _bitsandbytes_takes_int_mm() -> bool:
    from bitsandbytes.backends.cpu import ops as their_cpu_ops

    return bool(getattr(their_cpu_ops, "_has_avx512", False))


def test_the_probe_runs_on_real_tensors_inside_fake_mode():
    """A plan traced on fake tensors may be the first to ask which path runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _cpu_int8.int_mm_is_exact.cache_clear()
    with FakeTensorMode():
        exact = _cpu_int8.int_mm_is_exact()
    assert exact is _cpu_int8.int_mm_is_exact()


@pytest.mark.parametrize("shape", [(2048,), (1, 2048), (8, 2048), (2, 3, 2048)])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_linear_cpu_kernel_is_the_reference_bit_for_bit(shape, threshold, dtype):
    """int8_linear's CPU kernel calls the steps' kernels directly (no re-checks, no dispatch):
    the reference's bits, outlier columns included, and its error for NaN."""
    from tightfit.ops._autograd import _int8_linear_reference

    generator = torch.Generator().manual_seed(len(shape))
    A = torch.randn(shape, generator=generator).to(dtype)
    A[..., 5] = 9.0  # an outlier column at threshold 6
    weight = _ints("random", 96, 2048)
    SCB = torch.rand(96, generator=generator) + 0.5
    bias = torch.randn(96, generator=generator).to(dtype)
    with torch.inference_mode():
        expected = _int8_linear_reference(A, weight, SCB, bias, threshold)
        assert torch.equal(ops.int8_linear(A, weight, SCB, bias, threshold), expected)
        A.view(-1)[3] = float("nan")
        with pytest.raises(ValueError, match="NaN or inf"):
            ops.int8_linear(A, weight, SCB, bias, threshold)
