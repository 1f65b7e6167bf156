"""gemv_float8: the reference is layerwise casting's upcast then F.linear, bit for bit; the
native CPU kernel on every instruction set this CPU runs agrees with it (every byte of
both float8 kinds decoded exactly, NaN and inf where the reference has them, widths
around the vector steps, 1 to 9 tokens); the arguments are checked (D9); gradients."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit import FallbackWarning, StrictModeError
from tightfit.hooks.casting import _to_storage, _upcast
from tightfit.ops import _native, float8_gemv, gemv_float8, get_op

FORMATS = list(float8_gemv.FLOAT8_FORMATS)
KERNEL_PATHS = [path for path in _native.PATHS if _native.runnable(path)]


def _nmse(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float(((got - want) ** 2).sum() / (want**2).sum().clamp_min(1e-300))


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request, monkeypatch):
    monkeypatch.setenv(_native.PATH_VARIABLE, request.param)
    return request.param


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["channel", "tensor", None])
def test_the_reference_is_the_casting_hooks_upcast_then_linear(fmt, compute, mode):
    weight = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)) * 3
    stored, scale = _to_storage(weight, fmt, mode, compute)
    x = torch.randn(3, 40, dtype=compute)
    expected = torch.nn.functional.linear(x, _upcast(stored, scale, compute))
    assert torch.equal(get_op("gemv_float8").reference(x, stored, scale, None), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_byte_decodes_exactly(kernel_path, fmt):
    """One row per byte value, a one-hot x: the output is the byte's value, NaN and inf
    included (where x's zeros meet inf, NaN, as in the reference)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for width in (1, 7, 8, 16, 31, 32, 33, 64, 100):
        weight = codes.repeat_interleave(width).reshape(256, width).view(fmt)
        x = torch.zeros(1, width)
        x[0, width // 2] = 1.0
        expected = torch.nn.functional.linear(x, weight.float())
        assert torch.equal(gemv_float8(x, weight).nan_to_num(nan=1234.0), expected.nan_to_num(nan=1234.0)), width
        if width == 1:
            assert torch.equal(expected[0].nan_to_num(nan=1234.0), weight[:, 0].float().nan_to_num(nan=1234.0))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("cols", [1, 33, 1024])
def test_agrees_with_the_reference(kernel_path, fmt, tokens, cols):
    generator = torch.Generator().manual_seed(tokens * 1000 + cols)
    rows = 37
    weight = (torch.randn(rows, cols, generator=generator) * 20).to(fmt)
    scales = [
        None,
        torch.tensor(0.125),
        torch.ldexp(torch.ones(rows, 1), torch.randint(-12, 0, (rows, 1), generator=generator)),
    ]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(tokens, cols, generator=generator).to(dtype)
        bias = torch.randn(rows, generator=generator).to(dtype)
        for scale in scales:
            expected = get_op("gemv_float8").reference(x, weight, scale, bias)
            got = gemv_float8(x, weight, scale, bias)
            assert got.dtype == dtype and got.shape == (tokens, rows)
            assert torch.isfinite(expected).all() and _nmse(got, expected) < 1e-6, (dtype, scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_values_sit_where_the_reference_has_them(kernel_path, fmt):
    generator = torch.Generator().manual_seed(5)
    weight = torch.randint(0, 256, (64, 48), generator=generator, dtype=torch.int32).to(torch.uint8).view(fmt)
    x = torch.randn(2, 48, generator=generator)
    scale = torch.ldexp(torch.ones(64, 1), torch.randint(-4, 4, (64, 1), generator=generator))
    scale[3], scale[7] = float("inf"), float("nan")
    expected = get_op("gemv_float8").reference(x, weight, scale, None)
    got = gemv_float8(x, weight, scale)
    assert torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert _nmse(got[finite], expected[finite]) < 1e-10


def test_a_scale_past_the_e4m3fn_factor_is_still_exact(kernel_path):
    """A row scale of 2**121 and up overflows the vector path's factor (scale * 2**8): that row takes the table."""
    weight = (torch.randn(5, 40, generator=torch.Generator().manual_seed(1))).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0**125], [1.0], [2.0**121], [1.0], [2.0**-140]])
    x = torch.randn(3, 40) * 1e-3
    expected = get_op("gemv_float8").reference(x, weight, scale, None)
    got = gemv_float8(x, weight, scale)
    assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    assert _nmse(got, expected) < 1e-10


def test_leading_dimensions_and_empty_inputs():
    weight = torch.randn(6, 5).to(torch.float8_e5m2)
    x = torch.randn(2, 3, 5)
    assert torch.allclose(gemv_float8(x, weight), torch.nn.functional.linear(x, weight.float()), atol=1e-5)
    assert gemv_float8(torch.randn(0, 5), weight).shape == (0, 6)
    bias = torch.randn(6)
    assert torch.equal(
        gemv_float8(torch.randn(4, 0), torch.empty(6, 0, dtype=torch.float8_e4m3fn), None, bias), bias.expand(4, 6)
    )


def test_gradients_for_the_input_and_the_bias():
    weight = torch.randn(6, 16).to(torch.float8_e4m3fn)
    scale = torch.full((6, 1), 0.5)
    x = torch.randn(2, 16, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    gemv_float8(x, weight, scale, bias).pow(2).sum().backward()
    x2, bias2 = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, weight.float() * scale, bias2).pow(2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5) and torch.allclose(bias.grad, bias2.grad, atol=1e-5)


def test_no_native_build_runs_the_reference_with_a_warning(monkeypatch):
    monkeypatch.setattr(_native, "library", lambda: (None, "no C compiler (test)"))
    weight = torch.randn(6, 16).to(torch.float8_e4m3fn)
    x = torch.randn(1, 16)
    with pytest.warns(FallbackWarning, match="gemv_float8.*no C compiler"):
        assert torch.equal(gemv_float8(x, weight), get_op("gemv_float8").reference(x, weight, None, None))
    with tightfit.strict(), pytest.raises(StrictModeError):
        gemv_float8(x, weight)


W8 = torch.randn(8, 16).to(torch.float8_e4m3fn)
X = torch.randn(2, 16)
BAD = [
    ((X.long(), W8, None, None), ValueError, "A.dtype"),
    ((X, W8.float(), None, None), TypeError, "float8_e4m3fn or float8_e5m2"),
    ((X, W8.view(torch.uint8), None, None), TypeError, "float8_e4m3fn or float8_e5m2"),
    ((X, W8.to(torch.float8_e4m3fnuz), None, None), TypeError, "float8_e4m3fn or float8_e5m2"),
    ((X, W8.reshape(-1), None, None), ValueError, "contiguous 2-D"),
    ((X, W8.reshape(2, 4, 16), None, None), ValueError, "contiguous 2-D"),
    ((torch.randn(2, 8), W8.t(), None, None), ValueError, "contiguous 2-D"),
    ((X[:, :15], W8, None, None), ValueError, "in_features, 16"),
    ((torch.randn(()), W8, None, None), ValueError, "in_features"),
    ((X, W8, torch.ones(8), None), ValueError, r"one a row \(shape \(8, 1\)\)"),
    ((X, W8, torch.ones(7, 1), None), ValueError, "scale must hold"),
    ((X, W8, torch.ones(1, 8), None), ValueError, "scale must hold"),
    ((X, W8, torch.ones(8, 1, dtype=torch.int32), None), TypeError, "scale must be float32"),
    ((X, W8, torch.ones(8, 1, device="meta"), None), ValueError, "device"),
    ((X, W8, [1.0], None), (TypeError, RuntimeError), "scale"),  # the schema refuses it first
    ((X, W8, None, torch.ones(7)), ValueError, "bias must be float32"),
    ((X, W8, None, torch.ones(8, dtype=torch.bfloat16)), ValueError, "bias must be float32"),
    ((X, W8, None, torch.ones(8, 1)), ValueError, "bias must be"),
    ((X, W8.to("meta"), None, None), ValueError, "device"),
    ((X, W8, None, "bias"), (TypeError, RuntimeError), "bias"),
]


@pytest.mark.parametrize("entry", ["torch.ops", "direct", "public"])
@pytest.mark.parametrize(("args", "error", "match"), BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_arguments_are_refused(entry, args, error, match):
    call = {
        "torch.ops": torch.ops.tightfit.gemv_float8,
        "direct": get_op("gemv_float8"),
        "public": gemv_float8,
    }[entry]
    with pytest.raises(error, match=match):
        call(*args)


@pytest.mark.parametrize("compute", [torch.float16, torch.bfloat16])
def test_weights_the_upcast_overflows_are_infinite_as_in_the_reference(kernel_path, compute):
    """float16 holds e5m2's 57344 but not 57344 * 2: the reference's upcast makes it inf (and
    bfloat16 past its largest value), where float32 arithmetic alone would not."""
    codes = torch.tensor([[0x7B, 0x3C, 0x00, 0xFB] * 10, [0x3C] * 40, [0x7B] * 40], dtype=torch.uint8)
    weight = codes.view(torch.float8_e5m2)
    scale = torch.tensor([[2.0], [1.0], [2.0**113 if compute == torch.bfloat16 else 1.0]])
    x = torch.full((2, 40), 1e-3, dtype=compute)
    x[1, 2] = 0.0
    expected = get_op("gemv_float8").reference(x, weight, scale, None)
    got = gemv_float8(x, weight, scale)
    assert not torch.isfinite(expected).all()
    assert torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert _nmse(got[finite], expected[finite]) < 1e-6
