"""gemv_blockwise_int8, the "int8" compute choice of 8-bit blockwise layers: every
instruction-set path pinned in turn (AVX-512 with VBMI with and without VNNI, AVX-512,
AVX2, portable C, and the reference where there is no native build) held to the reference
within a float bound; the int16 table; the activations rounded as the reference rounds
them; the layer, config and run option that choose it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tightfit.ops as ops
from tightfit.app.run import RunOptions
from tightfit.ops.blockwise import _quantize_blockwise_reference
from tightfit.ops.blockwise_gemv import _nested, _scales
from tightfit.ops.blockwise_gemv_int8 import _gemv_blockwise_int8_reference, _int16_weight, int16_table
from tightfit.quant import Blockwise8Config, Linear8bit, NF4Config, quantize_
from zoo.kernels import sum_order_bound

#: (out, in, blocksize, tokens): the VNNI loop (in a multiple of 64), the AVX2 loop only (in
#: a multiple of 32, not 64), blocks larger than a row, the element-by-element loop (odd
#: in; blocks of 32), 8 tokens and 9.
SHAPES = [(37, 256, 64, 1), (24, 96, 128, 9), (8, 512, 4096, 8), (33, 65, 32, 2), (5, 192, 256, 3)]


def _quantized(rows: int, cols: int, blocksize: int, generator: torch.Generator):
    weight = torch.randn(rows, cols, generator=generator)
    return _quantize_blockwise_reference(weight, ops.dynamic_map(), blocksize)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("rows, cols, blocksize, tokens", SHAPES)
def test_every_path_agrees_with_the_reference(kernel, rows, cols, blocksize, tokens, nested):
    generator = torch.Generator().manual_seed(rows * cols + tokens)
    codes, absmax = _quantized(rows, cols, blocksize, generator)
    scales = _nested(absmax, 16) if nested else (absmax,)
    x = torch.randn(tokens, cols, generator=generator) * torch.rand(tokens, cols, generator=generator) * 4
    got = ops.gemv_blockwise_int8(x, codes, scales[0], None, blocksize, *scales[1:])
    want = _gemv_blockwise_int8_reference(x, codes, scales[0], ops.dynamic_map(), blocksize, *scales[1:])
    decoded = _int16_weight(codes, _scales(*scales) if nested else absmax, ops.dynamic_map(), blocksize)
    error = (got.double() - want.double()).abs()
    bound = sum_order_bound(x, decoded)
    assert got.shape == want.shape == (tokens, rows) and got.dtype == torch.float32
    assert bool((error <= bound).all()), (
        f"max error {error.max():.3g}, bound there {bound.flatten()[error.argmax()]:.3g}"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_come_back_in_their_dtype_as_the_reference_rounds(kernel, dtype):
    generator = torch.Generator().manual_seed(3)
    codes, absmax = _quantized(24, 256, 64, generator)
    x = torch.randn(2, 256, generator=generator).to(dtype)
    got = ops.gemv_blockwise_int8(x, codes, absmax, None, 64)
    want = _gemv_blockwise_int8_reference(x, codes, absmax, ops.dynamic_map(), 64)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)


def test_activations_round_half_to_even_as_the_reference(kernel):
    """Identity weight rows (the code for +1.0, blocks of absmax 1) read back the
    activations' int8 levels: ties round to even on every path, levels clamp at 127."""
    cols = 128
    levels = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.49, -0.51] * 11)[:cols]
    x = levels.reshape(1, cols)
    code = ops.dynamic_map()
    one, zero = int(code.argmax()), int(code.abs().argmin())
    codes = torch.full((cols, cols), zero, dtype=torch.uint8)
    codes.fill_diagonal_(one)
    got = ops.gemv_blockwise_int8(x, codes, torch.ones(cols * cols // 64), None, 64)
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    want_levels = torch.round(blocks * (127.0 / amax)).reshape(1, cols)
    unit = amax.repeat_interleave(32).reshape(1, cols) / 127
    assert torch.equal(torch.round(got / unit), want_levels)
    assert torch.equal(want_levels[0, 1:4], torch.tensor([0.0, 2.0, 2.0]))  # ties to even


def test_non_finite_activations_do_not_crash(kernel):
    codes, absmax = _quantized(16, 128, 64, torch.Generator().manual_seed(4))
    x = torch.randn(3, 128)
    x[0, 5], x[1, 40], x[2, 100] = float("nan"), float("inf"), -float("inf")
    got = ops.gemv_blockwise_int8(x, codes, absmax, None, 64)
    assert got.shape == (3, 16)
    assert bool(got.isnan().all(dim=1)[0])  # a NaN's block scale is NaN: the whole row of outputs


def test_the_int16_table_is_the_map_at_int16_levels():
    code = ops.dynamic_map()
    levels, unit = int16_table(code)
    assert levels.dtype == torch.int16 and levels.shape == (256,) and unit == pytest.approx(1 / 32767)
    assert (levels.float() * unit - code).abs().max() <= 0.5 / 32767 * 1.001
    zeros, zero_unit = int16_table(torch.zeros(256))
    assert not zeros.any() and zero_unit == 0.0
    doubled, doubled_unit = int16_table(code * 2)  # a map past 1 keeps its largest value at 32767
    assert torch.equal(doubled, levels) and doubled_unit == pytest.approx(2 * unit)


def test_empty_batched_and_gradient():
    codes, absmax = _quantized(8, 128, 64, torch.Generator().manual_seed(5))
    assert ops.gemv_blockwise_int8(torch.ones(0, 128), codes, absmax, None, 64).shape == (0, 8)
    x = torch.randn(2, 3, 128, requires_grad=True)
    out = ops.gemv_blockwise_int8(x, codes, absmax, None, 64)
    assert out.shape == (2, 3, 8)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ _int16_weight(codes, absmax, ops.dynamic_map(), 64))


# -- the layer, configs and option that choose it --------------------------------------------


def test_a_layer_with_int8_compute_runs_the_op_at_every_row_count():
    torch.manual_seed(0)
    layer = Linear8bit.from_linear(nn.Linear(256, 48).bfloat16(), blocksize=256, compute="int8")
    assert "compute=int8" in repr(layer)
    state = layer.quant_state
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        want = ops.gemv_blockwise_int8(x, layer.weight, state.absmax, state.code, state.blocksize)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), (want + layer.bias).to(torch.bfloat16))


def test_int8_compute_adds_little_to_8bit_loss_and_reaches_kept_layers():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64))
    floats, ints = copy.deepcopy(model), copy.deepcopy(model)
    quantize_(floats, Blockwise8Config(blocksize=256))
    quantize_(ints, Blockwise8Config(blocksize=256, compute="int8"))
    assert [m.compute for m in ints.modules() if isinstance(m, Linear8bit)] == ["int8", "int8"]
    x = torch.randn(5, 256)
    with torch.no_grad():
        full, float_8bit, int8_8bit = model(x), floats(x), ints(x)

    def error(a, b):
        return float((a - b).norm() / b.norm())

    assert error(int8_8bit, full) < 0.02  # the activations' int8 rounding: about 0.5% here
    assert error(float_8bit, full) < error(int8_8bit, full)
    kept = copy.deepcopy(model)
    quantize_(kept, NF4Config(keep_8bit=("2",), compute="int8"))
    assert isinstance(kept[2], Linear8bit) and kept[2].compute == "int8"


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Blockwise8Config(compute="int16"), "compute='int16' is not accepted; accepted: float, int8"),
        (lambda: Linear8bit.from_linear(nn.Linear(64, 8), compute=None), "compute=None is not accepted"),
    ],
)
def test_a_wrong_compute_choice_is_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_the_run_takes_int8_compute_with_8bit():
    assert RunOptions(quant="8bit", compute="int8").compute == "int8"
