"""The many-token forward of the blockwise layers (and the backward QLoRA runs), a tile of
weight rows at a time (``tightfit.quant._tiled``): against the reference (the weight
decoded whole, ``F.linear``), the tiles' boundaries, and the transient bytes the planner
predicts (``transient_bytes``) against those the forward holds.

Agreement. A tile's product is the reference's columns computed by a narrower GEMM: each
output is the same dot product, summed in another order where the BLAS picks another
kernel for the narrower shape; the input's gradient is summed over tiles of output
features. Measured over this file's cases (4 to 16 tiles a weight, 2 to 300 tokens; MKL
on an AVX-512 CPU), largest difference from the reference:

- forward, float32: 4.8e-7 absolute (1.9e-7 relative to the largest output; 30 of 36
  forwards bit-equal); bfloat16: 3.8e-6 (1.9e-6; 35 of 36 bit-equal); float16: none.
  At the default tile (8 MiB) float32 was bit-equal for 2048x1500, 2048x5632 and
  4096x4096 weights at 2, 128 and 300 tokens; bfloat16 at 300 tokens differed by one
  step of the output (0.0039, 0.0078).
- input gradient, float32: 2.5e-6 (6.3e-7 relative); bfloat16: 0.0156 (one step, 3.9e-3
  relative); float16: 0.00195 (4.9e-4).

The assertions hold every value to the rounding-error bound of two summation orders of a
K-term dot product, ``2 K u32 sum_k |x_k w_k|`` (u32 = 2**-24, float32 accumulation),
plus one rounding to the output dtype (unit roundoff u) on each side, and for the
half-precision gradient one rounding of each tile's partial product, at most
``u sum_k |g_k w_k|`` in all. The measured differences reach at most a quarter of it
(the half-precision gradients), a fortieth in float32.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tightfit
from tightfit.memory import LiveTensorBytes
from tightfit.quant import _tiled, storage_format
from tightfit.quant import functional as QF
from tightfit.quant.modules import Linear4bit, Linear8bit

FORMATS = {
    "nf4": lambda linear: Linear4bit.from_linear(linear, quant_type="nf4"),
    "fp4 bs32": lambda linear: Linear4bit.from_linear(linear, quant_type="fp4", blocksize=32),
    "nf4 nested": lambda linear: Linear4bit.from_linear(linear, quant_type="nf4", compress_statistics=True),
    "8bit bs256": lambda linear: Linear8bit.from_linear(linear, blocksize=256),
    "8bit nested bs64": lambda linear: Linear8bit.from_linear(linear, blocksize=64, nested=True),
}
#: (format, (out_features, in_features), bias): in_features a multiple of the blocksize
#: or not, odd sizes, a weight smaller than one block (one tile), a tall weight of many
#: tiles; nested scales and not.
CASES = [
    ("nf4", (300, 96), True),
    ("nf4", (257, 65), False),
    ("nf4", (7, 5), True),
    ("fp4 bs32", (40, 1000), True),
    ("fp4 bs32", (1024, 32), False),
    ("nf4 nested", (300, 96), False),
    ("nf4 nested", (40, 1000), True),
    ("8bit bs256", (257, 65), True),
    ("8bit bs256", (1024, 32), True),
    ("8bit bs256", (7, 5), False),
    ("8bit nested bs64", (300, 96), True),
    ("8bit nested bs64", (40, 1000), False),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SMALL_TILE = 8192  # bytes: 5 to 16 tiles for these small weights


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(_tiled, "TILE_BYTES", SMALL_TILE)


def _tiles(monkeypatch, shape: tuple[int, int], dtype: torch.dtype, count: int | None) -> None:
    """Tiles of about a ``count``-th of the weight, or (None) the fewest rows that start on a block."""
    monkeypatch.setattr(_tiled, "TILE_BYTES", 1 if count is None else shape[0] * shape[1] * dtype.itemsize // count)


def _layer(kind: str, shape: tuple[int, int], bias: bool = True, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(sum(shape))
    linear = nn.Linear(shape[1], shape[0], bias=bias).to(dtype)
    return FORMATS[kind](linear)


def _reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The weight decoded whole, in the input's dtype, and ``F.linear``."""
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return torch.nn.functional.linear(x, layer.dequantize().to(x.dtype), bias)


def _rounding_bound(a: torch.Tensor, b: torch.Tensor, expected: torch.Tensor, partials: bool = False) -> torch.Tensor:
    """How far two ways of computing ``a @ b`` (float32 accumulation, then rounded to
    ``expected``'s dtype) may be apart: ``2 K u32 sum_k |a_k b_k|`` for the two summation
    orders of K terms, one rounding of the output (unit roundoff u) on each side, and with
    ``partials`` one rounding of each tile's partial product, ``u sum_k |a_k b_k|`` in all."""
    k = a.shape[-1]
    products = a.abs().double().reshape(-1, k) @ b.abs().double()
    u = UNIT_ROUNDOFF[expected.dtype]
    bound = 2 * k * UNIT_ROUNDOFF[torch.float32] * products + 2 * u * expected.double().abs().reshape(products.shape)
    return bound + u * products if partials else bound


def _assert_close(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    excess = (got.double() - expected.double()).abs().reshape(bound.shape) - bound
    assert bool((excess <= 0).all()), f"largest excess over the rounding bound: {excess.max().item():.3g}"


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- agreement with the reference ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "shape", "bias"), CASES, ids=str)
def test_the_tiled_forward_agrees_with_the_reference(monkeypatch, kind, shape, bias, dtype):
    # about four tiles, the last shorter; a few cases in tiles of the fewest rows that start on a block
    _tiles(monkeypatch, shape, dtype, None if shape in ((257, 65), (40, 1000)) and dtype == torch.float32 else 4)
    layer = _layer(kind, shape, bias)
    grid = _tiled.layout(layer.weight, layer.quant_state, shape[1], dtype.itemsize)
    assert grid is not None and grid.whole == (shape == (7, 5))  # the others take several tiles
    weight = layer.dequantize().to(dtype)
    tokens = [(2, shape[1]), (3, 17, shape[1]), (300, shape[1])] if dtype == torch.float32 else [(3, 17, shape[1])]
    for size in tokens:
        x = _x(size, dtype)
        with torch.no_grad():
            got = layer(x)
        expected = _reference(layer, x)
        _assert_close(got, expected, _rounding_bound(x, weight.T, expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_weight_stored_in_bfloat16_is_decoded_in_it_then_cast(small_tiles, dtype):
    """As bitsandbytes computes it: decoded into the stored dtype, then cast to the input's."""
    for kind in ("nf4 nested", "8bit bs256"):
        layer = _layer(kind, (257, 65), dtype=torch.bfloat16)
        x = _x((11, 65), dtype)
        expected = _reference(layer, x)
        with torch.no_grad():
            got = layer(x)
        _assert_close(got, expected, _rounding_bound(x, layer.dequantize().to(dtype).T, expected))


def test_one_token_of_an_8bit_layer_and_a_one_dimensional_input(small_tiles):
    layer = _layer("8bit nested bs64", (300, 96))
    weight = layer.dequantize()
    for shape in ((96,), (1, 96), (1, 1, 96)):
        x = _x(shape, torch.float32)
        with torch.no_grad():
            got = layer(x)
        expected = _reference(layer, x)
        _assert_close(got, expected, _rounding_bound(x, weight.T, expected))


def test_no_tokens_decode_nothing(small_tiles):
    layer = _layer("nf4", (300, 96))
    with LiveTensorBytes() as tracker, torch.no_grad():
        out = layer(torch.randn(0, 96))
    assert out.shape == (0, 300) and tracker.peak == 0
    assert Linear4bit.transient_bytes((300, 96), 0, 0, torch.float32) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["nf4", "nf4 nested", "8bit bs256"])
def test_the_tiled_backward_agrees_with_the_reference(small_tiles, kind, dtype):
    shape = (300, 96)
    layer = _layer(kind, shape)
    layer.bias.requires_grad_(True)
    weight = layer.dequantize().to(dtype)
    x, grad = _x((4, 9, 96), dtype), _x((4, 9, 300), dtype, seed=2)
    results = []
    for forward in (layer, lambda inputs: _reference(layer, inputs)):
        inputs = x.clone().requires_grad_(True)
        layer.bias.grad = None
        out = forward(inputs)
        out.backward(grad)
        results.append((out, inputs.grad, layer.bias.grad))
    (out, grad_x, grad_bias), (ref_out, ref_x, ref_bias) = results
    _assert_close(out, ref_out, _rounding_bound(x, weight.T, ref_out))
    _assert_close(grad_x, ref_x, _rounding_bound(grad, weight, ref_x, partials=dtype != torch.float32))
    torch.testing.assert_close(grad_bias, ref_bias)


def test_the_backward_holds_a_tile_not_the_decoded_weight(monkeypatch):
    monkeypatch.setattr(_tiled, "TILE_BYTES", 64 * 1024)
    layer = _layer("nf4", (1024, 256))
    x = torch.randn(8, 256, requires_grad=True)
    out = layer(x)
    grad = torch.ones_like(out)
    with LiveTensorBytes() as tracker:
        out.backward(grad)
    decoded = 1024 * 256 * 4
    # the input's gradient (8 KiB), one decoded tile (64 KiB) and what autograd makes
    assert tracker.peak < decoded // 8
    torch.testing.assert_close(x.grad, grad @ layer.dequantize(), rtol=1e-5, atol=1e-5)


# -- tiles ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tile_bytes", [1, 2048, 1 << 20])
@pytest.mark.parametrize(
    ("out_features", "in_features", "blocksize"),
    [(300, 96, 64), (257, 65, 64), (40, 1000, 64), (1000, 4095, 4096), (77, 33, 1000), (5, 3, 32), (64, 4096, 32)],
)
def test_tiles_start_on_a_block_and_cover_the_weight(out_features, in_features, blocksize, tile_bytes):
    rows = _tiled.tile_rows(out_features, in_features, blocksize, 4, tile_bytes)
    grid = _tiled.Layout(out_features, in_features, blocksize, rows)
    tiles = list(grid.tiles())
    assert tiles[0][0] == 0 and tiles[-1][1] == out_features
    assert all(before[1] == after[0] for before, after in zip(tiles, tiles[1:]))
    one_block = (
        in_features * blocksize // math.gcd(in_features, blocksize)
    )  # the fewest whole rows that start on a block
    for r0, r1 in tiles:
        assert r0 * in_features % blocksize == 0  # so also on a byte of 4-bit codes (blocksize >= 32)
        assert r1 == out_features or (r1 - r0) * in_features % one_block == 0
        assert (r1 - r0) * in_features * 4 <= max(tile_bytes, one_block * 4)
    assert grid.blocks(*tiles[-1])[1] == -(-out_features * in_features // blocksize)  # the partial last block


def test_codes_that_tiling_cannot_slice_are_refused_by_the_op():
    layer = _layer("nf4", (300, 96))
    with pytest.raises(ValueError, match="packed bytes"):
        QF.matmul_4bit(torch.randn(4, 96), layer.weight[:-1], layer.quant_state)


# -- the transient bytes ---------------------------------------------------------------------


@pytest.mark.parametrize("tile_bytes", [SMALL_TILE, None], ids=["8KiB", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("kind", "blocksize", "nested"),
    [("nf4", 64, False), ("nf4 nested", 64, True), ("8bit bs256", 256, False), ("8bit nested bs64", 64, True)],
)
def test_the_forward_holds_its_transient_bytes_above_its_output(
    monkeypatch, kind, blocksize, nested, dtype, tile_bytes
):
    """Counted by tightfit's tracker of live tensors, exactly: a tile, and a nested state's scales."""
    if tile_bytes is not None:
        monkeypatch.setattr(_tiled, "TILE_BYTES", tile_bytes)
    shape = (300, 96)
    layer = _layer(kind, shape, dtype=dtype)
    for tokens in (2, tightfit.ops.FEW_TOKENS + 1, 37):
        x = _x((tokens, 96), dtype)
        with torch.no_grad(), LiveTensorBytes() as tracker:
            out = layer(x)
        predicted = type(layer).transient_bytes(shape, tokens, 0, dtype, blocksize=blocksize, nested=nested)
        if tokens <= tightfit.ops.FEW_TOKENS:  # the few-token kernel decodes nothing: the tile is an upper bound
            assert tracker.peak - out.nbytes <= predicted
        else:
            assert tracker.peak - out.nbytes == predicted
        whole = 300 * 96 * dtype.itemsize
        assert predicted < whole if tile_bytes is not None else predicted >= whole


@pytest.mark.parametrize("name", ["nf4", "8bit"])
def test_the_catalogue_predicts_one_default_tile(name):
    """A weight larger than a tile, quantized with the format's default config."""
    shape = (1500, 2048)  # 12 MiB decoded in float32
    torch.manual_seed(0)
    linear = nn.Linear(2048, 1500)
    layer = Linear4bit.from_linear(linear) if name == "nf4" else Linear8bit.from_linear(linear)
    x = torch.randn(tightfit.ops.FEW_TOKENS + 1, 2048)  # more rows than the few-token kernels take
    with torch.no_grad(), LiveTensorBytes() as tracker:
        out = layer(x)
    predicted = storage_format(name).transient_bytes(shape, x.shape[0], 0, torch.float32)
    assert tracker.peak - out.nbytes == predicted == _tiled.TILE_BYTES < 1500 * 2048 * 4
