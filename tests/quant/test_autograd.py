"""Backward through quantized layers (QLoRA): a frozen 4-bit / 8-bit / int8 base with
trainable low-rank adapters gets the gradients a plain float Linear holding the
dequantized weight would give, eagerly and under torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tightfit.ops
from tightfit.quant.modules import Linear4bit, Linear8bit, LinearInt8

LAYERS = {
    "nf4": lambda linear: Linear4bit.from_linear(linear, quant_type="nf4"),
    "fp4": lambda linear: Linear4bit.from_linear(linear, quant_type="fp4"),
    "8bit": lambda linear: Linear8bit.from_linear(linear, blocksize=256),
    "int8": lambda linear: LinearInt8.from_linear(linear, threshold=6.0),
}


class LoRA(nn.Module):
    """``base(x) + x @ A.T @ B.T``: the adapter a QLoRA fine-tune trains."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        generator = torch.Generator().manual_seed(1)
        self.A = nn.Parameter(torch.randn(rank, in_features, generator=generator) * 0.1)
        self.B = nn.Parameter(torch.randn(out_features, rank, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.to(x.dtype).t()) @ self.B.to(x.dtype).t()


def _pair(kind: str, bias: bool = True) -> tuple[LoRA, LoRA]:
    """The adapted quantized layer and the same adapter on a float Linear holding its dequantized weight."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    quantized = LAYERS[kind](linear)
    plain = nn.Linear(64, 48, bias=bias)
    with torch.no_grad():
        plain.weight.copy_(quantized.dequantize().float())
        if bias:
            plain.bias.copy_(quantized.bias)
    plain.requires_grad_(False)
    return LoRA(quantized, 64, 48), LoRA(plain, 64, 48)


def _grads(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad()
    model(x).backward(grad)
    return {"x": x.grad, "A": model.A.grad, "B": model.B.grad}


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("rows", [1, 5])  # one token takes the fused 4-bit kernel, more decode the weight
def test_gradients_equal_a_float_linear_with_the_dequantized_weight(kind, rows):
    quantized, plain = _pair(kind)
    x = torch.randn(2, rows, 64)
    x[0, 0, 3] = 9.0  # an outlier column for int8's threshold
    grad = torch.randn(2, rows, 48)
    got, expected = _grads(quantized, x, grad), _grads(plain, x, grad)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
    assert all(buffer.grad is None for buffer in quantized.base.buffers())


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_trainable_bias_gets_its_gradient(kind):
    quantized, plain = _pair(kind)
    quantized.base.bias.requires_grad_(True)
    plain.base.bias.requires_grad_(True)
    x, grad = torch.randn(3, 64), torch.randn(3, 48)
    quantized(x).backward(grad)
    plain(x).backward(grad)
    torch.testing.assert_close(quantized.base.bias.grad, plain.base.bias.grad)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_adapters_train_and_the_base_stays_frozen(kind):
    model, _ = _pair(kind)
    before = {name: tensor.clone() for name, tensor in model.base.state_dict().items()}
    optimizer = torch.optim.AdamW([model.A, model.B], lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    x, target = torch.randn(16, 64, generator=generator), torch.randn(16, 48, generator=generator)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    for name, tensor in model.base.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_precision_gradients_match_within_rounding(dtype):
    quantized, plain = _pair("nf4")
    plain.base.to(dtype)
    x, grad = torch.randn(1, 64, dtype=dtype), torch.randn(1, 48, dtype=dtype)
    got, expected = _grads(quantized, x, grad), _grads(plain, x, grad)
    tolerance = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {}
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **tolerance, msg=name)


def _eager_and_compiled(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Output, input gradient and adapter gradients of ``model`` run eagerly and compiled."""
    results = []
    for candidate in (model, torch.compile(copy.deepcopy(model), fullgraph=True)):
        inputs = x.clone().requires_grad_(True)
        out = candidate(inputs)
        out.backward(grad)
        adapters = [p.grad for n, p in candidate.named_parameters() if n.endswith((".A", ".B"))]
        results.append((out, inputs.grad, *adapters))
    return results


def _layers(adapt: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [
        Linear4bit.from_linear(nn.Linear(64, 64), quant_type="nf4"),
        Linear8bit.from_linear(nn.Linear(64, 64), blocksize=256),
        LinearInt8.from_linear(nn.Linear(64, 48)),
    ]
    return nn.Sequential(*(LoRA(layer, layer.in_features, layer.out_features) if adapt else layer for layer in layers))


def test_eager_and_compiled_agree_in_bfloat16_with_bias_at_batch_one():
    """At one token a 4-bit layer adds the bias in float32 and rounds once, which is what
    inductor computes for ``out + bias.to(bfloat16)`` (it fuses the cast away): the two
    agree bit for bit (adding the rounded bias differed by up to one bfloat16 step)."""
    eager, traced = _eager_and_compiled(
        _layers(adapt=False), torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(1, 48, dtype=torch.bfloat16)
    )
    for expected, got in zip(eager, traced, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_eager_and_compiled_agree_with_adapters():
    eager, traced = _eager_and_compiled(_layers(adapt=True), torch.randn(3, 64), torch.randn(3, 48))
    for expected, got in zip(eager, traced, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (
            "gemv_4bit",
            lambda: (
                torch.randn(1, 64, requires_grad=True),
                *tightfit.ops.quantize_4bit(torch.randn(8, 64), 64, "nf4")[:1],
                [8, 64],
                tightfit.ops.quantize_4bit(torch.randn(8, 64), 64, "nf4")[1],
                64,
                "nf4",
            ),
        ),
        (
            "int8_linear",
            lambda: (
                torch.randn(3, 64, requires_grad=True),
                torch.randint(-127, 128, (8, 64), dtype=torch.int8),
                torch.rand(8) + 0.5,
                torch.randn(8, requires_grad=True),
                6.0,
            ),
        ),
    ],
)
def test_opcheck_with_autograd(op, args):
    torch.library.opcheck(getattr(torch.ops.tightfit, op).default, args())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.randn(2, 64), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8)), "weight must be int8"),
        ((torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(7)), "SCB must be float32"),
        ((torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), torch.ones(3)), "bias must be"),
        ((torch.randn(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8), None, -1.0), "threshold"),
    ],
)
def test_int8_linear_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        tightfit.ops.int8_linear(*args)
