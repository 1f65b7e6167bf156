"""The quantized layers' few-token forward past the dispatcher (``tightfit.ops._direct``):
the same bits as the op it stands in for, taken only where the op would add nothing, bound
again whenever the layer's tensors change, and never keeping a dropped weight alive."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tightfit import ops
from tightfit.ops._direct import binding_of
from tightfit.quant import functional as QF
from tightfit.quant.modules import Linear4bit, Linear8bit, LinearInt8


def _linear(out_features: int, in_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _layers(bias: bool) -> dict[str, nn.Module]:
    base = _linear(96, 256, bias)
    return {
        "nf4": Linear4bit.from_linear(base),
        "fp4 nested": Linear4bit.from_linear(base, quant_type="fp4", compress_statistics=True),
        "nf4 int8": Linear4bit.from_linear(base, compute="int8"),
        "nf4 int8 nested": Linear4bit.from_linear(base, compute="int8", compress_statistics=True),
        "8bit": Linear8bit.from_linear(base, blocksize=256),
        "8bit nested": Linear8bit.from_linear(base, blocksize=256, nested=True),
        "8bit int8": Linear8bit.from_linear(base, blocksize=256, compute="int8"),
        "8bit int8 nested": Linear8bit.from_linear(base, blocksize=256, nested=True, compute="int8"),
        "int8": LinearInt8.from_linear(base, threshold=6.0),
    }


def _op(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward through its op (what the layer ran before the direct path)."""
    if isinstance(layer, Linear4bit):
        return QF.matmul_4bit(x, layer.weight, layer.quant_state, bias=layer.bias, compute=layer.compute)
    if isinstance(layer, Linear8bit) and layer.compute == "int8":
        state = layer.quant_state
        absmax, *nested = QF._stored_scales(state)
        result = ops.gemv_blockwise_int8(x, layer.weight, absmax, state.code, state.blocksize, *nested)
        return result if layer.bias is None else (result + layer.bias).to(x.dtype)
    if isinstance(layer, Linear8bit):
        return QF._decoded_linear(x, layer.weight, layer.quant_state, layer.bias)
    return ops.int8_linear(x, layer.weight, layer.SCB, layer.bias, layer.threshold)


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_direct_forward_is_the_ops_bits(dtype, bias):
    for name, layer in _layers(bias).items():
        if bias:  # in the compute dtype, as a model holds it
            layer.bias = nn.Parameter(layer.bias.detach().to(dtype), requires_grad=False)
        for shape in [(1, 256), (1, 1, 256), (3, 256), (2, 4, 256)]:
            x = torch.randn(shape).clamp(-3, 3).to(dtype)  # LLM.int8(): no outlier column
            with torch.inference_mode():
                direct = layer(x)
                assert binding_of(layer).bound is not None, name
                expected = _op(layer, x)
            assert direct.dtype == dtype and direct.shape == (*shape[:-1], 96), name
            assert torch.equal(direct, expected), f"{name} {dtype} {shape}: differs from the op"


def test_direct_path_left_where_the_op_must_run():
    layer = Linear4bit.from_linear(_linear(32, 64, bias=True))
    x = torch.randn(2, 64, requires_grad=True)
    y = layer(x)
    assert y.grad_fn is not None  # a gradient to record: the op, with its backward
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    with _Passing():  # a dispatch mode (memory measurement, fake tensors) sees every op
        layer(torch.randn(2, 64))
    assert binding_of(layer).bound is None
    with torch.no_grad():
        layer(torch.randn(9, 64))  # more rows than the few-token kernels take
        layer(torch.randn(64, 2).t())  # not contiguous
    assert binding_of(layer).bound is None


def test_binding_follows_the_layers_tensors_and_settings():
    layer = Linear4bit.from_linear(_linear(48, 128, bias=False, seed=1))
    other = Linear4bit.from_linear(_linear(48, 128, bias=False, seed=2))
    x = torch.randn(1, 128)
    with torch.no_grad():
        first = layer(x)
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer(x), other(x)) and not torch.equal(layer(x), first)
        layer.compute = "int8"
        assert torch.equal(layer(x), _op(layer, x))
        layer.compute = "float"
        layer.to(torch.float16)  # the scales keep their dtype, the binding is made again
        assert torch.equal(layer(x), other(x))


def test_binding_keeps_no_dropped_weight_alive():
    layer = Linear8bit.from_linear(_linear(64, 256, bias=False), blocksize=256)
    with torch.no_grad():
        layer(torch.randn(1, 256))
        dropped = weakref.ref(layer.weight)
        layer.weight = torch.full_like(layer.weight, 3)  # as an offloading hook swaps it out
        gc.collect()
        assert dropped() is None
        x = torch.randn(1, 256)
        assert torch.equal(layer(x), _op(layer, x))  # bound again, to the new weight


def test_bound_layers_copy_and_pickle():
    layer = Linear4bit.from_linear(_linear(32, 64, bias=True), compute="int8")
    x = torch.randn(1, 64)
    with torch.no_grad():
        expected = layer(x)
        for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert torch.equal(copied(x), expected)
            assert binding_of(copied) is not binding_of(layer)


_SWAPPED = """
import dataclasses, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from tightfit.quant.modules import Linear4bit, Linear8bit, LinearInt8
base, small = torch.nn.Linear(256, 128), torch.nn.Linear(64, 64)
def nf4(): return Linear4bit.from_linear(base, compute="int8")
def byte8(): return Linear8bit.from_linear(base, blocksize=64, compute="int8")
def int8(): return LinearInt8.from_linear(base)
def fake(layer):
    with FakeTensorMode():
        return torch.empty(layer.weight.shape, dtype=layer.weight.dtype)
swaps = [
    (lambda: nf4().to("meta"), None),
    (lambda: byte8().to("meta"), None),
    (lambda: int8().to("meta"), None),
    (nf4, lambda l: setattr(l, "weight", l.weight[:8].clone())),
    (byte8, lambda l: setattr(l, "weight", l.weight[:, :16].clone())),
    (int8, lambda l: setattr(l, "weight", l.weight[:, :16].clone())),
    (int8, lambda l: setattr(l, "SCB", l.SCB[:3].clone())),
    (int8, lambda l: setattr(l, "bias", torch.nn.Parameter(torch.zeros(3), requires_grad=False))),
    (nf4, lambda l: setattr(l, "quant_state", Linear4bit.from_linear(small).quant_state)),
    (byte8, lambda l: setattr(l, "quant_state", Linear8bit.from_linear(small, blocksize=64).quant_state)),
    (nf4, lambda l: setattr(l, "weight", fake(l))),
]
for make, swap in swaps:
    layer = make()
    with torch.no_grad():
        if layer.weight.device.type == "cpu":
            layer(torch.randn(1, 256))  # bound to the layer's own tensors first
        if swap is not None:
            swap(layer)
        try:
            layer(torch.randn(1, 256))
            print("ran")
        except Exception:
            print("refused")
"""


def test_a_layer_whose_tensors_the_op_would_refuse_takes_the_op_and_is_refused_not_read():
    """Tensors the kernel must not read (on meta, of the wrong size, a quant state of
    another shape, a fake tensor), set as a hook or a user sets a layer's attributes after
    it was bound: the binding is made again only past the op's own check, so each call takes
    the op, which refuses it. In a subprocess, so that a crash fails this test, not the run."""
    done = subprocess.run([sys.executable, "-c", _SWAPPED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["refused"] * 11


def test_a_changed_quant_state_field_binds_again():
    layer = Linear4bit.from_linear(_linear(32, 128, bias=False, seed=3))
    x = torch.randn(1, 128)
    with torch.no_grad():
        layer(x)
        layer.quant_state = dataclasses.replace(layer.quant_state, quant_type="fp4")  # the same tensors
        assert torch.equal(layer(x), _op(layer, x))


@pytest.mark.parametrize("layer_type", [Linear4bit, Linear8bit])
def test_the_binding_checks_the_layer_on_its_own_device(layer_type):
    """The op's check before a binding is made with a row on the layer's device: made with a
    CPU row, it refused every accelerator's layer (devices differ), and no GPU layer ever
    took its bound kernel. Meta stands for any device other than the CPU here."""
    layer = layer_type.from_linear(_linear(32, 128, bias=False)).to("meta")
    absmax, *nested = QF._stored_scales(layer.quant_state)
    layer._check_op_arguments(absmax, tuple(nested))  # raises nothing
