"""gemv_4bit_int8, the "int8" compute choice of 4-bit layers: every instruction-set path
pinned in turn (AVX-512 with and without VNNI, AVX2, portable C, and the reference where
there is no native build) held to the reference within a float bound; the activations
rounded exactly as the reference rounds them; the layers, configs and the run's option
that choose it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tightfit.ops as ops
from tightfit.app.run import RunOptions
from tightfit.ops.blockwise import _quantize_4bit_reference
from tightfit.ops.blockwise_gemv import _nested
from tightfit.ops.blockwise_gemv_int8 import _gemv_4bit_int8_reference, _int8_weight, int8_table
from tightfit.quant import Linear4bit, NF4Config, quantize_
from zoo.kernels import sum_order_bound

#: (out, in, blocksize, tokens): the vector loops (in a multiple of 128; blocks of 64, 128,
#: larger than a row), the element-by-element loop (odd in, blocks of 32), 8 tokens and 9.
SHAPES = [(37, 256, 64, 1), (24, 128, 128, 9), (8, 512, 4096, 8), (33, 65, 32, 2), (5, 192, 64, 3)]


@pytest.mark.parametrize("quant_type, nested", [("nf4", False), ("fp4", True)])
@pytest.mark.parametrize("rows, cols, blocksize, tokens", SHAPES)
def test_every_path_agrees_with_the_reference(kernel, quant_type, rows, cols, blocksize, tokens, nested):
    generator = torch.Generator().manual_seed(rows * cols + tokens)
    weight = torch.randn(rows, cols, generator=generator)
    packed, absmax = _quantize_4bit_reference(weight, blocksize, quant_type, torch.uint8)
    scales = _nested(absmax, 32) if nested else (absmax,)
    x = torch.randn(tokens, cols, generator=generator) * torch.rand(tokens, cols, generator=generator) * 4
    got = ops.gemv_4bit_int8(x, packed, [rows, cols], scales[0], blocksize, quant_type, *scales[1:])
    want = _gemv_4bit_int8_reference(x, packed, [rows, cols], scales[0], blocksize, quant_type, *scales[1:])
    decoded = _int8_weight(
        packed, [rows, cols], absmax.float() if not nested else _scales_of(scales), blocksize, quant_type
    )
    error = (got.double() - want.double()).abs()
    bound = sum_order_bound(x, decoded)
    assert got.shape == want.shape == (tokens, rows) and got.dtype == torch.float32
    assert bool((error <= bound).all()), (
        f"max error {error.max():.3g}, bound there {bound.flatten()[error.argmax()]:.3g}"
    )


def _scales_of(nested: tuple) -> torch.Tensor:
    from tightfit.ops.blockwise_gemv import _scales

    return _scales(*nested)


def test_activations_round_half_to_even_as_the_reference(kernel):
    """One-hot weight rows read back the activations' int8 levels exactly: the ties of
    x * 127 / max (0.5, 1.5, 2.5, ...) round to even on every path, and the levels clamp at 127."""
    cols = 128
    levels = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.49, -0.51] * 11)[:cols]
    x = levels.reshape(1, cols)
    one = int((int8_table("nf4") == 127).nonzero()[0, 0])  # the code for +1.0
    zero = int((int8_table("nf4") == 0).nonzero()[0, 0])
    codes = torch.full((cols, cols), zero, dtype=torch.uint8)
    codes.fill_diagonal_(one)
    packed = (codes.reshape(-1, 2)[:, 0] << 4 | codes.reshape(-1, 2)[:, 1]).contiguous()
    absmax = torch.ones(cols * cols // 64)
    got = ops.gemv_4bit_int8(x, packed, [cols, cols], absmax, 64, "nf4")
    # each x-block of 32 has max 127 (or 126.5): the level is round(x * 127 / max)
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    want_levels = torch.round(blocks * (127.0 / amax)).reshape(1, cols)
    assert torch.equal(torch.round(got / (amax.repeat_interleave(32).reshape(1, cols) / 127)), want_levels)
    assert torch.equal(want_levels[0, 1:4], torch.tensor([0.0, 2.0, 2.0]))  # ties to even


def test_non_finite_activations_do_not_crash(kernel):
    packed, absmax = _quantize_4bit_reference(torch.randn(16, 128), 64, "nf4", torch.uint8)
    x = torch.randn(3, 128)
    x[0, 5], x[1, 40], x[2, 100] = float("nan"), float("inf"), -float("inf")
    got = ops.gemv_4bit_int8(x, packed, [16, 128], absmax, 64, "nf4")
    assert got.shape == (3, 16)
    assert bool(got.isnan().all(dim=1)[0])  # a NaN's block scale is NaN: the whole row of outputs


def test_empty_and_batched_inputs():
    packed, absmax = _quantize_4bit_reference(torch.randn(8, 128), 64, "nf4", torch.uint8)
    assert ops.gemv_4bit_int8(torch.ones(0, 128), packed, [8, 128], absmax, 64, "nf4").shape == (0, 8)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    got = ops.gemv_4bit_int8(x, packed, [8, 128], absmax, 64, "nf4")
    assert got.shape == (2, 3, 8) and got.dtype == torch.bfloat16


def test_the_int8_table_is_the_4bit_table_at_int8_levels():
    for quant_type in ("nf4", "fp4"):
        table = int8_table(quant_type)
        assert table.dtype == torch.int8 and table.shape == (16,)
        assert (table.float() / 127 - ops.code_4bit(quant_type)).abs().max() <= 0.5 / 127


def test_the_gradient_passes_the_activation_rounding_straight_through():
    packed, absmax = _quantize_4bit_reference(torch.randn(16, 128), 64, "nf4", torch.uint8)
    x = torch.randn(4, 128, requires_grad=True)
    out = ops.gemv_4bit_int8(x, packed, [16, 128], absmax, 64, "nf4")
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ _int8_weight(packed, [16, 128], absmax, 64, "nf4"))


# -- the layers and options that choose it ---------------------------------------------------


def test_a_layer_with_int8_compute_runs_the_op_at_every_row_count():
    torch.manual_seed(0)
    linear = nn.Linear(256, 48).bfloat16()
    layer = Linear4bit.from_linear(linear, compute="int8")
    assert "compute=int8" in repr(layer)
    state = layer.quant_state
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        want = ops.gemv_4bit_int8(x, layer.weight, [48, 256], state.absmax, state.blocksize, "nf4")
        with torch.no_grad():
            torch.testing.assert_close(layer(x), (want + layer.bias).to(torch.bfloat16))


def test_quantize_with_int8_compute_sets_every_4bit_layer_and_adds_little_loss():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64))
    floats, ints = copy.deepcopy(model), copy.deepcopy(model)
    quantize_(floats, NF4Config())
    quantize_(ints, NF4Config(compute="int8"))
    assert [m.compute for m in ints.modules() if isinstance(m, Linear4bit)] == ["int8", "int8"]
    x = torch.randn(5, 256)
    with torch.no_grad():
        full, nf4, nf4_int8 = model(x), floats(x), ints(x)

    def error(a, b):
        return float((a - b).norm() / b.norm())

    # NF4 itself loses about 10% here; int8 activations add about a tenth of that
    assert error(nf4_int8, nf4) < 0.03
    assert error(nf4_int8, full) < 1.1 * error(nf4, full)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: NF4Config(compute="int4"), "compute='int4' is not accepted; accepted: float, int8"),
        (lambda: Linear4bit.from_linear(nn.Linear(64, 8), compute=8), "compute=8 is not accepted"),
        (lambda: RunOptions(compute="int8"), "compute='int8' needs a blockwise quant (nf4, fp4 or 8bit)"),
        (lambda: RunOptions(quant="int8", compute="int8"), "compute='int8' needs a blockwise quant"),
    ],
)
def test_a_wrong_compute_choice_is_named(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()
