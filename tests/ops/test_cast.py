"""``tightfit.ops.cast``: bit-identical to torch's conversion, fast path and fallbacks,
out= buffers, torch.compile, opcheck, and every bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit
from tightfit.backends import FLOAT8_DTYPES
from tightfit.ops import _numba
from tightfit.ops._cpu_cast import MIN_FAST_NUMEL
from tightfit.ops.cast import _float32_probe_values as float32_probe_values
from zoo.commands import side_by_side

WIDE = [torch.float32, torch.float16, torch.bfloat16]
FLOAT8 = sorted(FLOAT8_DTYPES, key=str)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    if torch.empty((), dtype=dtype).element_size() == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


def big(values: torch.Tensor) -> torch.Tensor:
    """Repeat ``values`` past the fast-path threshold, with an odd length."""
    repeats = MIN_FAST_NUMEL // max(values.numel(), 1) + 2
    return values.repeat(repeats)[: max(MIN_FAST_NUMEL + 1, values.numel()) | 1]


@pytest.mark.parametrize("target", WIDE + FLOAT8, ids=str)
@pytest.mark.parametrize("source", FLOAT8, ids=str)
def test_every_float8_pattern_widens_or_converts_like_torch(source, target):
    x = big(every_pattern(source))
    assert same_bits(tightfit.ops.cast(x, target), x.to(target))


@pytest.mark.parametrize("target", FLOAT8, ids=str)
@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16], ids=str)
def test_every_16bit_pattern_narrows_like_torch(source, target):
    x = big(every_pattern(source))
    assert same_bits(tightfit.ops.cast(x, target), x.to(target))


@pytest.mark.parametrize("target", FLOAT8, ids=str)
def test_float32_boundaries_round_like_torch(target):
    x = float32_probe_values()
    assert same_bits(tightfit.ops.cast(x, target), x.to(target))


def test_e4m3fn_saturates_and_keeps_nan_like_torch():
    x = torch.tensor([1e9, -1e9, float("inf"), float("-inf"), float("nan"), 464.0, 470.0]).repeat(MIN_FAST_NUMEL)
    got = tightfit.ops.cast(x, torch.float8_e4m3fn)
    assert same_bits(got, x.to(torch.float8_e4m3fn))


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 70), min_size=0, max_size=3),
    pair=st.sampled_from([(s, t) for s in WIDE for t in FLOAT8[:2]] + [(s, t) for s in FLOAT8[:2] for t in WIDE]),
    scale=st.sampled_from([1e-6, 1.0, 300.0, 1e5]),
    transpose=st.booleans(),
)
def test_random_shapes_and_layouts(shape, pair, scale, transpose):
    source, target = pair
    generator = torch.Generator().manual_seed(len(shape) * 1000 + sum(shape))
    x = (torch.randn(shape, generator=generator) * scale).to(source)
    if transpose and x.dim() >= 2:
        x = x.transpose(0, -1)
    got = tightfit.ops.cast(x, target)
    assert got.is_contiguous()
    assert same_bits(got, x.to(target))


def test_large_non_contiguous_input_uses_the_fast_path_correctly():
    x = torch.randn(2 * MIN_FAST_NUMEL + 6, 3).to(torch.float8_e5m2).t()
    assert same_bits(tightfit.ops.cast(x, torch.bfloat16), x.to(torch.bfloat16))


def test_out_buffer_is_written_and_returned():
    x = torch.randn(MIN_FAST_NUMEL + 1).to(torch.float8_e4m3fn)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    assert tightfit.ops.cast(x, torch.bfloat16, out=out) is out
    assert same_bits(out, x.to(torch.bfloat16))


def test_non_contiguous_out_buffer():
    x = torch.randn(8, MIN_FAST_NUMEL // 4).to(torch.float8_e4m3fn)
    out = torch.empty(x.shape[::-1], dtype=torch.float32).t()
    tightfit.ops.cast(x, torch.float32, out=out)
    assert same_bits(out.contiguous(), x.to(torch.float32))


def test_without_numba_the_cpu_kernel_warns_once_and_stays_exact(monkeypatch):
    monkeypatch.setattr(_numba, "load_numba", lambda: (None, "numba is not usable (ImportError: test)"))
    x = torch.randn(MIN_FAST_NUMEL).to(torch.float8_e4m3fn)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = tightfit.ops.cast(x, torch.bfloat16)
        tightfit.ops.cast(x, torch.bfloat16)
    found = [w for w in record if issubclass(w.category, tightfit.FallbackWarning)]
    assert len(found) == 1 and "numba is not usable" in str(found[0].message)
    assert same_bits(first, x.to(torch.bfloat16))
    with tightfit.strict(), pytest.raises(tightfit.StrictModeError):
        tightfit.ops.cast(x, torch.bfloat16)


def test_numba_threads_follow_torch():
    numba, _ = _numba.load_numba()
    _numba.match_torch_threads(numba)
    assert numba.get_num_threads() == min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


def test_a_numba_kernel_leaves_torchs_thread_count_as_the_process_set_it():
    """numba's OpenMP layer, launched, sets the process's OpenMP threads to all of its own:
    a process given one thread (OMP_NUM_THREADS=1, as each torchrun rank) keeps one."""
    script = (
        "import torch, tightfit.ops\n"
        f"x = torch.randn({MIN_FAST_NUMEL * 2}).to(torch.float8_e4m3fn)\n"
        "tightfit.ops.cast(x, torch.bfloat16)\n"
        "print(torch.get_num_threads())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", TIGHTFIT_STRICT="1")  # strict: the numba kernel ran, no fallback
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1"]


def test_fast_cpu_kernel_runs_without_fallback_warnings():
    x = torch.randn(MIN_FAST_NUMEL * 2).to(torch.float8_e4m3fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tightfit.FallbackWarning)
        tightfit.ops.cast(x, torch.bfloat16)
        tightfit.ops.cast(x.to(torch.float32), torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(5).to(torch.float8_e4m3fn), torch.bfloat16),
        (torch.randn(3, 4), torch.float8_e5m2),
        (torch.randn(0).to(torch.bfloat16), torch.float8_e4m3fn),
        (torch.randn(MIN_FAST_NUMEL + 1).to(torch.float8_e4m3fn), torch.float16),
    ],
    ids=["fp8-bf16", "fp32-e5m2-2d", "empty", "fast-path"],
)
def test_opcheck_cast(args):
    torch.library.opcheck(torch.ops.tightfit.cast.default, args, test_utils=OPCHECK_UTILS)
    assert_schema_holds(torch.ops.tightfit.cast.default, args, mutated=())


def test_opcheck_cast_into():
    x = torch.randn(MIN_FAST_NUMEL + 1)
    args = (x, torch.empty(x.shape, dtype=torch.float8_e4m3fn))
    torch.library.opcheck(torch.ops.tightfit.cast_into.default, args, test_utils=OPCHECK_UTILS)
    assert_schema_holds(torch.ops.tightfit.cast_into.default, args, mutated=(1,))


# opcheck's test_schema does arithmetic on the inputs, which torch does not implement for
# float8 on the CPU; assert_schema_holds checks the same contract (which inputs are
# mutated, no output aliases an input) directly.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def assert_schema_holds(op, args, mutated):
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    result = op(*args)
    for index, (old, new) in enumerate(zip(before, args)):
        if isinstance(old, torch.Tensor) and index not in mutated:
            assert same_bits(old, new), f"argument {index} was mutated but the schema says it is not"
    if isinstance(result, torch.Tensor):
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.numel():
                assert result.untyped_storage().data_ptr() != arg.untyped_storage().data_ptr()


def test_cast_under_torch_compile():
    def store_and_load(x):
        return tightfit.ops.cast(tightfit.ops.cast(x * 2, torch.float8_e4m3fn), torch.bfloat16) + 1

    x = torch.randn(MIN_FAST_NUMEL + 3)
    compiled = torch.compile(store_and_load, backend="aot_eager", fullgraph=True)
    assert same_bits(compiled(x), store_and_load(x))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: tightfit.ops.cast([1.0], torch.bfloat16), TypeError, "x must be Tensor, got list"),
        (lambda: tightfit.ops.cast(torch.ones(2), "bfloat16"), TypeError, "dtype must be dtype, got str"),
        (
            lambda: tightfit.ops.cast(torch.ones(2, dtype=torch.int32), torch.float8_e4m3fn),
            ValueError,
            "x.dtype=torch.int32 is not accepted",
        ),
        (lambda: tightfit.ops.cast(torch.ones(2), torch.int8), ValueError, "dtype=torch.int8 is not accepted"),
        (lambda: tightfit.ops.cast(torch.ones(2), torch.float64), ValueError, "accepted: "),
        (lambda: tightfit.ops.cast(torch.ones(2), torch.bfloat16, out=[0, 0]), TypeError, "out must be Tensor"),
        (
            lambda: tightfit.ops.cast(torch.ones(2), torch.bfloat16, out=torch.empty(2)),
            ValueError,
            "out has dtype torch.float32 but dtype=torch.bfloat16",
        ),
        (
            lambda: tightfit.ops.cast(torch.ones(2), torch.bfloat16, out=torch.empty(3, dtype=torch.bfloat16)),
            ValueError,
            r"out has shape \(3,\) but x has shape \(2,\)",
        ),
        (
            lambda: tightfit.ops.cast(
                torch.ones(2), torch.bfloat16, out=torch.empty(2, dtype=torch.bfloat16, device="meta")
            ),
            ValueError,
            "out is on meta but x is on cpu",
        ),
    ],
)
def test_cast_rejects_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_cast_rejects_out_sharing_storage_with_input():
    buffer = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="out shares its storage with x"):
        tightfit.ops.cast(buffer.view(torch.float8_e4m3fn)[:8], torch.float16, out=buffer)
    assert torch.equal(buffer, torch.zeros(8, dtype=torch.float16))  # untouched


RAW_CAST_INTO_MISMATCH = """
import torch, tightfit
x = torch.zeros(1 << 16).to(torch.float8_e4m3fn)
out = torch.empty(16, dtype=torch.bfloat16)
try:
    torch.ops.tightfit.cast_into(x, out)
except ValueError as error:
    print("rejected:", error)
"""


def test_raw_op_with_a_short_out_is_rejected_not_a_crash(scripts):
    done = scripts["short out"].result()
    assert done.returncode == 0, done.stderr
    assert "rejected: out has shape (16,) but x has shape (65536,)" in done.stdout


CONCURRENT_CASTS = """
import threading, torch, tightfit
x = torch.randn(1 << 20).to(torch.float8_e4m3fn)
expected = x.to(torch.bfloat16).view(torch.int16)
ok = []
def work():
    for _ in range(5):
        ok.append(torch.equal(tightfit.ops.cast(x, torch.bfloat16).view(torch.int16), expected))
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
print(sum(ok), len(ok))
"""


def _python(code: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
    )


@pytest.fixture(scope="module")
def scripts():
    """The scripts above, each in a fresh process, started side by side."""
    with side_by_side(
        {
            "short out": partial(_python, RAW_CAST_INTO_MISMATCH, 120),
            "concurrent": partial(_python, CONCURRENT_CASTS, 300, NUMBA_THREADING_LAYER="workqueue"),
        }
    ) as runs:
        yield runs


def test_concurrent_casts_under_numbas_workqueue_layer(scripts):
    done = scripts["concurrent"].result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["20", "20"]


def test_gradients_pass_straight_through():
    x = torch.randn(64, requires_grad=True)
    y = tightfit.ops.cast(tightfit.ops.cast(x, torch.float8_e4m3fn), torch.float32)
    (y * 3).sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.full((64,), 3.0))


def test_out_that_requires_grad_is_rejected():
    with pytest.raises(ValueError, match="out requires grad"):
        tightfit.ops.cast(torch.ones(2), torch.float32, out=torch.zeros(2, requires_grad=True))


def test_fallback_warning_points_at_the_callers_line():
    x = torch.randn(MIN_FAST_NUMEL).to(torch.float8_e4m3fn)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_numba, "load_numba", lambda: (None, "numba is not usable (test)"))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            tightfit.ops.cast(x, torch.bfloat16, out=torch.empty(x.shape, dtype=torch.bfloat16))
    found = [w for w in record if issubclass(w.category, tightfit.FallbackWarning)]
    assert len(found) == 1 and "'cast_into'" in str(found[0].message)
    assert found[0].filename == __file__
