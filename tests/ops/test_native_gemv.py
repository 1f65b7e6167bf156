"""The native few-token kernels (gemv_4bit, gemv_blockwise): every instruction-set path this
CPU can execute pinned in turn (TIGHTFIT_CPU_KERNEL_PATH), plus the numba / reference
fallback, each held to the reference within a rigorous float bound; the build cached per
machine; a machine without a compiler warned once and served by the fallback."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit
import tightfit.ops as ops
from tightfit._errors import FallbackWarning, StrictModeError
from tightfit.ops import _native
from tightfit.ops.blockwise import _dequantize_4bit_reference, _quantize_4bit_reference, _quantize_blockwise_reference
from tightfit.ops.codes import dynamic_map

RUNNABLE = [path for path in _native.PATHS if _native.runnable(path)]


@pytest.fixture(params=[*_native.PATHS, "none"])
def path(request, monkeypatch):
    """Each path pinned in turn; "none" is the numba / reference fallback. A path this CPU
    cannot execute is skipped (its instructions would fault)."""
    if request.param != "none" and not _native.runnable(request.param):
        pytest.skip(f"this CPU lacks {request.param}")
    monkeypatch.setenv(_native.PATH_VARIABLE, request.param)
    return request.param


def _bound(x: torch.Tensor, weight: torch.Tensor, rounded: bool) -> torch.Tensor:
    """Largest |got - reference| two float32 sums of the same K products may differ by, in any
    order (2 * K * 2**-24 * sum |w x|), plus, where the reference rounds the decoded weight
    and the output to ``x``'s 16-bit dtype, 2**-8 of sum |w x| for each."""
    magnitude = x.double().abs() @ weight.double().abs().t()
    factor = 2 * weight.shape[1] * 2.0**-24 + (2 * 2.0**-8 if rounded else 0)
    return magnitude * factor + 1e-30


def _check(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    error = (got.double() - want.double()).abs()
    bound = _bound(x.reshape(-1, x.shape[-1]), weight, x.dtype != torch.float32).reshape(error.shape)
    assert bool((error <= bound).all()), f"max error {error.max():.3g}, bound there {bound[error.argmax()]:.3g}"


#: (out, in, blocksize): in a multiple of 32 (the vector loops), blocks spanning rows
#: (96 % 64), odd sizes (the element-by-element loop), blocks larger than a row.
SHAPES_4BIT = [(64, 96, 64), (24, 96, 64), (33, 65, 64), (40, 256, 128), (8, 64, 4096), (7, 3, 32)]


@pytest.mark.parametrize("quant_type, dtype", [("nf4", torch.bfloat16), ("fp4", torch.float32)])
@pytest.mark.parametrize("rows, cols, blocksize", SHAPES_4BIT)
@pytest.mark.parametrize("tokens", [1, 9])  # a token; a group of 8 and one more
def test_gemv_4bit_every_path(path, quant_type, rows, cols, blocksize, tokens, dtype):
    if path != "none":
        assert _native.library()[1] == path
    generator = torch.Generator().manual_seed(rows * cols + tokens)
    packed, absmax = _quantize_4bit_reference(
        torch.randn(rows, cols, generator=generator), blocksize, quant_type, torch.uint8
    )
    weight = _dequantize_4bit_reference(packed, absmax, blocksize, quant_type, [rows, cols], torch.float32)
    x = torch.randn(tokens, cols, generator=generator).to(dtype)
    want = torch.nn.functional.linear(x, weight.to(dtype))
    _check(ops.gemv_4bit(x, packed, [rows, cols], absmax, blocksize, quant_type), want, x, weight)


#: 8-bit blocksizes: powers of two (vector loops) and not (element by element), spanning rows.
SHAPES_8BIT = [(64, 96, 64), (16, 192, 128), (24, 96, 256), (40, 256, 4096), (33, 65, 64), (24, 96, 1000), (5, 32, 1)]


@pytest.mark.parametrize("rows, cols, blocksize", SHAPES_8BIT)
@pytest.mark.parametrize("tokens, dtype", [(1, torch.bfloat16), (9, torch.float32)])
def test_gemv_blockwise_every_path(path, rows, cols, blocksize, tokens, dtype):
    generator = torch.Generator().manual_seed(rows * cols + tokens)
    codes, absmax = _quantize_blockwise_reference(
        torch.randn(rows, cols, generator=generator), dynamic_map(), blocksize
    )
    weight = ops.dequantize_blockwise(codes, absmax, None, blocksize)
    x = torch.randn(2, (tokens + 1) // 2, cols, generator=generator)[:, :tokens].to(dtype)
    want = torch.nn.functional.linear(x, weight.to(dtype))
    _check(ops.gemv_blockwise(x, codes, absmax, None, blocksize), want, x, weight)


@settings(max_examples=20, deadline=None)
@given(
    path=st.sampled_from(RUNNABLE),
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 40),
    chunks=st.integers(1, 6),
    extra=st.sampled_from([0, 0, 1, 7]),
    blocksize=st.sampled_from([32, 64, 128, 256]),
    tokens=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_generated_shapes(path, bits, rows, chunks, extra, blocksize, tokens, seed):
    os.environ[_native.PATH_VARIABLE] = path
    try:
        cols = 32 * chunks + extra
        generator = torch.Generator().manual_seed(seed)
        values = torch.randn(rows, cols, generator=generator) * torch.rand(rows, 1, generator=generator)
        x = torch.randn(tokens, cols, generator=generator)
        if bits == 4:
            packed, absmax = _quantize_4bit_reference(values, blocksize, "nf4", torch.uint8)
            weight = _dequantize_4bit_reference(packed, absmax, blocksize, "nf4", [rows, cols], torch.float32)
            got = ops.gemv_4bit(x, packed, [rows, cols], absmax, blocksize, "nf4")
        else:
            codes, absmax = _quantize_blockwise_reference(values, dynamic_map(), blocksize)
            weight = ops.dequantize_blockwise(codes, absmax, None, blocksize)
            got = ops.gemv_blockwise(x, codes, absmax, None, blocksize)
        _check(got, x @ weight.t(), x, weight)
    finally:
        del os.environ[_native.PATH_VARIABLE]


def test_nan_and_inf_propagate_as_in_the_reference(path):
    packed, absmax = _quantize_4bit_reference(torch.randn(8, 64), 64, "nf4", torch.uint8)
    x = torch.ones(1, 64)
    x[0, 5] = math.inf
    got = ops.gemv_4bit(x, packed, [8, 64], absmax, 64, "nf4")
    want = ops.get_op("gemv_4bit").reference(x, packed, [8, 64], absmax, 64, "nf4")
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


def test_empty_inputs(path):
    packed, absmax = _quantize_4bit_reference(torch.randn(8, 64), 64, "nf4", torch.uint8)
    assert ops.gemv_4bit(torch.ones(0, 64), packed, [8, 64], absmax, 64, "nf4").shape == (0, 8)
    codes, absmax8 = _quantize_blockwise_reference(torch.randn(8, 64), dynamic_map(), 64)
    assert ops.gemv_blockwise(torch.ones(2, 0, 64), codes, absmax8, None, 64).shape == (2, 0, 8)


def test_pin_is_checked(monkeypatch):
    monkeypatch.setenv(_native.PATH_VARIABLE, "avx1024")
    with pytest.raises(ValueError, match="TIGHTFIT_CPU_KERNEL_PATH='avx1024' is not a path; accepted: auto"):
        _native.selected_path()
    monkeypatch.setenv(_native.PATH_VARIABLE, "avx512")
    monkeypatch.setattr(_native, "cpu_flags", lambda: frozenset({"sse2"}))
    with pytest.raises(RuntimeError, match="needs CPU features this CPU lacks: avx2, avx512bw"):
        _native.selected_path()


def test_auto_follows_torchs_capability(monkeypatch):
    monkeypatch.delenv(_native.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert _native.selected_path() == "portable"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert _native.selected_path() == ("avx2" if _native.runnable("avx2") else "portable")


def test_without_a_compiler_the_fallback_runs_and_says_so(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", os.environ["TIGHTFIT_CACHE_DIR"] + "/no-compiler")
    monkeypatch.delenv(_native.PATH_VARIABLE, raising=False)
    _native._load.cache_clear()
    try:
        packed, absmax = _quantize_4bit_reference(torch.randn(8, 64), 64, "nf4", torch.uint8)
        x = torch.randn(1, 64)
        with pytest.warns(FallbackWarning, match="native .* kernels could not be built .*no C compiler"):
            got = ops.gemv_4bit(x, packed, [8, 64], absmax, 64, "nf4")
        weight = _dequantize_4bit_reference(packed, absmax, 64, "nf4", [8, 64], torch.float32)
        _check(got, x @ weight.t(), x, weight)
        with tightfit.strict(), pytest.raises(StrictModeError, match="gemv_4bit"):
            ops.gemv_4bit(x, packed, [8, 64], absmax, 64, "nf4")
    finally:
        _native._load.cache_clear()


def test_a_build_is_reused_by_later_processes(tmp_path, monkeypatch):
    """This process compiles; a later one finds the library and compiles nothing (the
    compiler is a wrapper that logs each compile)."""
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo compile >> {log};; esac\nexec cc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.delenv(_native.PATH_VARIABLE, raising=False)
    packed, absmax = _quantize_4bit_reference(torch.randn(8, 64), 64, "nf4", torch.uint8)
    _native._load.cache_clear()
    try:
        with tightfit.strict():
            ops.gemv_4bit(torch.randn(1, 64), packed, [8, 64], absmax, 64, "nf4")
        built_here = _native.library()[1]
    finally:
        _native._load.cache_clear()
    compiled = len(log.read_text().splitlines())
    script = (
        "import torch, tightfit.ops as ops\n"
        "from tightfit.ops import _native\n"
        "from tightfit.ops.blockwise import _quantize_4bit_reference\n"
        "p, a = _quantize_4bit_reference(torch.randn(8, 64), 64, 'nf4', torch.uint8)\n"
        "ops.gemv_4bit(torch.randn(1, 64), p, [8, 64], a, 64, 'nf4')\n"
        "print(_native.library()[1])\n"
    )
    env = {**os.environ, "TIGHTFIT_STRICT": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    built = sorted((tmp_path / "kernels").glob("*.so"))
    assert [path.name.split("-")[1] for path in built] == [built_here] == [run.stdout.strip()]
    # this process compiled (a source at a time, then a link); the later one nothing
    assert len(log.read_text().splitlines()) == compiled > 0


@pytest.mark.parametrize("bits", [4, 8])
def test_double_quantized_scales_decode_in_the_kernel(path, bits):
    """Scales passed as stored (uint8 codes, nested absmax, offset) give the product of the
    float scales the reference decodes from them."""
    generator = torch.Generator().manual_seed(bits)
    values, x = torch.randn(48, 96, generator=generator), torch.randn(3, 96, generator=generator)
    if bits == 4:
        codes, absmax = _quantize_4bit_reference(values, 32, "nf4", torch.uint8)
    else:
        codes, absmax = _quantize_blockwise_reference(values, dynamic_map(), 32)
    offset = absmax.mean()
    qabsmax, absmax2 = _quantize_blockwise_reference(absmax - offset, dynamic_map(), 16)
    scales = ops.dequantize_blockwise(qabsmax, absmax2, None, 16) + offset
    nested = (absmax2, dynamic_map(), 16, offset)
    if bits == 4:
        weight = _dequantize_4bit_reference(codes, scales, 32, "nf4", [48, 96], torch.float32)
        got = ops.gemv_4bit(x, codes, [48, 96], qabsmax, 32, "nf4", *nested)
    else:
        weight = ops.dequantize_blockwise(codes, scales, None, 32)
        got = ops.gemv_blockwise(x, codes, qabsmax, None, 32, *nested)
    _check(got, x @ weight.t(), x, weight)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"absmax2": None}, ValueError, "code2 or offset is given without absmax2"),
        ({"absmax": torch.zeros(5, dtype=torch.uint8)}, ValueError, "absmax .double-quantized. must be 1-D uint8"),
        ({"absmax2": torch.zeros(3)}, ValueError, "absmax2 must be 1-D float32 with 1 values"),
        ({"code2": torch.zeros(255)}, ValueError, "code2 must be 1-D float32 of 256"),
        ({"offset": torch.ones(2)}, ValueError, "offset must be a float32 tensor of one value"),
        ({"offset": 0.5}, (TypeError, RuntimeError), "offset"),  # torch.ops' schema refuses it first
        ({"nested_blocksize": 0}, ValueError, "blocksize=0 is not accepted"),
    ],
)
def test_hostile_double_quantized_scales_are_refused(change, error, match):
    codes, absmax = _quantize_4bit_reference(torch.randn(8, 64), 64, "nf4", torch.uint8)
    args = {
        "absmax": absmax.to(torch.uint8),
        "absmax2": torch.ones(1),
        "code2": dynamic_map(),
        "nested_blocksize": 256,
        "offset": torch.tensor(0.0),
    } | change
    x = torch.randn(1, 64)
    with pytest.raises(error, match=match):
        ops.gemv_4bit(x, codes, [8, 64], args["absmax"], 64, "nf4", *list(args.values())[1:])
    with pytest.raises(error, match=match):
        torch.ops.tightfit.gemv_4bit(x, codes, [8, 64], args["absmax"], 64, "nf4", *list(args.values())[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_bit_equal_to_the_reference_on_every_path(path, dtype):
    """The many-token forwards decode tiles through the native dequantize: bit for bit the
    reference's float32 decode and its cast (odd counts, partial last blocks included)."""
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(1001, generator=generator)
    packed, absmax = _quantize_4bit_reference(values, 64, "nf4", torch.uint8)
    got = ops.dequantize_4bit(packed, absmax, 64, "nf4", [1001], dtype)
    want = _dequantize_4bit_reference(packed, absmax, 64, "nf4", [1001], dtype)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    codes, absmax8 = _quantize_blockwise_reference(values, dynamic_map(), 100)
    got = ops.dequantize_blockwise(codes, absmax8, None, 100, dtype)
    want = ops.get_op("dequantize_blockwise").reference(codes, absmax8, dynamic_map(), 100, dtype)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
