"""The quantized layers' few-token forward past the dispatcher on a CUDA GPU: the op's own
Triton kernel called with the layer's tensors as they are at each call. On the CPU the
bound GPU kernel runs under Triton's interpreter (its tensors stay on the CPU); on a GPU the
layers take it in their forward."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torch import nn

from tightfit.ops._direct import binding_of
from tightfit.quant import functional as QF
from tightfit.quant.modules import Linear4bit, Linear8bit

pytest.importorskip("triton")
GPU = torch.cuda.is_available()
if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = torch.device("cuda" if GPU else "cpu")


def _layers() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = nn.Linear(256, 96, bias=True)
    return {
        "nf4": Linear4bit.from_linear(base),
        "fp4 nested": Linear4bit.from_linear(base, quant_type="fp4", compress_statistics=True),
        "nf4 odd width": Linear4bit.from_linear(nn.Linear(65, 40)),
        "8bit": Linear8bit.from_linear(base, blocksize=256),
        "8bit nested": Linear8bit.from_linear(base, blocksize=256, nested=True),
    }


def _through_op(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, Linear4bit):
        return QF.matmul_4bit(x, layer.weight, layer.quant_state, bias=layer.bias)
    return QF._decoded_linear(x, layer.weight, layer.quant_state, layer.bias)


@pytest.mark.parametrize(
    ("name", "dtype"), [(name, torch.bfloat16) for name in sorted(_layers())] + [("nf4", torch.float32)]
)
def test_the_bound_gpu_kernel_is_the_ops(name, dtype):
    layer = _layers()[name].to(DEVICE)
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    kernel = layer._bind_gpu()
    got = kernel(x)
    expected = _through_op(layer, x) if layer.bias is None else _through_op(layer, x) - layer.bias
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert got.dtype == dtype and got.shape == (3, layer.out_features)


def test_int8_compute_binds_no_gpu_kernel():
    layer = Linear4bit.from_linear(nn.Linear(64, 32), compute="int8")
    assert layer._bind_gpu() is None


def test_the_bound_gpu_kernel_holds_the_layer_weakly():
    layer = _layers()["nf4"]
    kernel = layer._bind_gpu()
    watch = weakref.ref(layer)
    del layer
    gc.collect()
    assert watch() is None and callable(kernel)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(_layers()))
def test_cuda_forward_takes_the_bound_kernel_with_the_ops_bits(name):
    layer = _layers()[name].to("cuda")
    x = torch.randn(1, 2, layer.in_features, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
    assert binding_of(layer).bound is not None
    assert torch.equal(got, _through_op(layer, x))
    layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)  # a new tensor: bound again
    with torch.no_grad():
        assert torch.equal(layer(x), got)
