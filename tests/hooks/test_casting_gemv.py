"""Layerwise casting's few-token route: an nn.Linear with a float8 weight on the CPU that gets
at most FEW_TOKENS rows runs gemv_float8 on the stored weight (no upcast copy); every other
forward (more rows, its own forward, a hook inside, a traced graph, another storage dtype)
upcasts as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit
from tightfit.hooks import HookRegistry, ModuleHook, apply_layerwise_casting, apply_offloading, remove_offloading
from tightfit.hooks.casting import _upcast
from tightfit.memory import allocated_peak
from tightfit.ops import FEW_TOKENS
from zoo.hooks import relative_error, stack

F8 = torch.float8_e4m3fn


def _linear(out_features=256, in_features=512, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _upcast_forward(layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    weight = _upcast(layer._parameters["weight"], getattr(layer, "weight_scale", None), dtype)
    return torch.nn.functional.linear(x, weight, None if layer.bias is None else layer.bias.to(dtype))


class Spy(ModuleHook):
    """Records the weight dtype each forward sees (a user hook: order 50, inside casting)."""

    def __init__(self):
        self.seen = []

    def pre_forward(self, module, args, kwargs):
        self.seen.append(module.weight.dtype)
        return args, kwargs


@pytest.fixture
def calls(monkeypatch):
    """The gemv_float8 calls the hook makes."""
    made = []
    real = tightfit.ops.gemv_float8

    def counting(*args):
        made.append(args)
        return real(*args)

    monkeypatch.setattr(tightfit.ops, "gemv_float8", counting)
    return made


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("scale", "bias"), [("channel", True), ("tensor", False), (None, True)])
def test_few_tokens_read_the_stored_weight(calls, storage, compute, scale, bias):
    layer = _linear(bias=bias).to(compute)
    apply_layerwise_casting(layer, storage, compute, scale=scale)
    for shape in [(512,), (1, 512), (FEW_TOKENS, 512), (2, 3, 512)]:
        x = torch.randn(shape, dtype=compute)
        with torch.no_grad():
            got = layer(x)
        expected = _upcast_forward(layer, x, compute)
        assert got.dtype == compute and got.shape == expected.shape
        assert relative_error(got, expected) < (1e-6 if compute == torch.float32 else 1e-2)
        assert torch.equal(
            got, tightfit.ops.gemv_float8(x, layer.weight, getattr(layer, "weight_scale", None), layer.bias)
        )
    assert len(calls) == 4 + 4  # four forwards, each then called again above
    assert layer.weight.dtype == storage  # the stored weight is back in its slot


def test_more_rows_upcast_as_before(calls):
    layer = _linear()
    apply_layerwise_casting(layer, F8, torch.float32)
    x = torch.randn(FEW_TOKENS + 1, 512)
    with torch.no_grad():
        assert torch.equal(layer(x), _upcast_forward(layer, x, torch.float32))
    assert calls == []


def test_a_few_token_forward_allocates_no_upcast_copy():
    layer = _linear(out_features=1024, in_features=1024, bias=False)
    apply_layerwise_casting(layer, F8, torch.float32)
    with torch.inference_mode():
        few = allocated_peak(lambda: layer(torch.randn(1, 1024)))
        many = allocated_peak(lambda: layer(torch.randn(FEW_TOKENS + 1, 1024)))
    upcast = 1024 * 1024 * 4
    assert few < 64 * 1024 < upcast <= many


def test_what_the_route_must_not_skip_upcasts(calls):
    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    own = OwnForward(64, 32)
    apply_layerwise_casting(own, F8, torch.float32)
    hooked = _linear(32, 64)
    apply_layerwise_casting(hooked, F8, torch.float32)
    spy = HookRegistry.of(hooked).register("spy", Spy())
    bf16 = _linear(32, 64)
    apply_layerwise_casting(bf16, torch.bfloat16, torch.float32)
    x = torch.randn(1, 64)
    with torch.no_grad():
        own(x), hooked(x), bf16(x)
    assert calls == [] and spy.seen == [torch.float32]


def test_the_input_dtype_error_is_the_one_f_linear_raises(calls):
    layer = _linear(32, 64)
    apply_layerwise_casting(layer, F8, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
    assert calls == []
    assert layer.weight.dtype == F8


def test_gradients_flow_to_the_input_and_the_bias():
    layer = _linear(32, 64)
    apply_layerwise_casting(layer, F8, torch.float32)
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).pow(2).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()
    weight = _upcast(layer._parameters["weight"], layer.weight_scale, torch.float32)
    torch.nn.functional.linear(x2, weight, bias).pow(2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5) and torch.allclose(layer.bias.grad, bias.grad, atol=1e-5)
    assert layer.weight.grad is None


def test_a_model_decodes_close_to_the_upcast_and_compiles_without_the_route(calls):
    model = stack()
    x = torch.randn(1, 32)
    apply_layerwise_casting(model, F8, torch.float32)
    with torch.no_grad():
        eager = model(x)
        assert calls  # the Linears took the route
        count = len(calls)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert len(calls) == count  # the traced graph upcasts
    assert relative_error(compiled, eager) < 1e-6


def test_offloaded_to_disk_the_route_reads_the_mapped_weight(calls, tmp_path):
    model = stack()
    apply_layerwise_casting(model, F8, torch.float32)
    x = torch.randn(2, 32)
    with torch.no_grad():
        expected = model(x)
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    finally:
        remove_offloading(model)
    assert calls
