"""Backward through quantized layers (QLoRA): a frozen 4-bit / 8-bit / int8 base with
trainable low-rank adapters gets the gradients a plain float Linear holding the
dequantized weight would give, eagerly and under torch.compile."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import tightfit.ops
from tightfit.memory import LiveTensorBytes, tensor_bytes
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
            "gemv_blockwise",
            lambda: (
                torch.randn(2, 64, requires_grad=True),
                torch.randint(0, 256, (8, 64), dtype=torch.uint8),
                torch.randint(0, 256, (8,), dtype=torch.uint8),
                tightfit.ops.dynamic_map(),
                64,
                torch.rand(2) + 0.5,
                tightfit.ops.dynamic_map(),
                4,
                torch.tensor(0.25),
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


# -- what autograd keeps between the forward and the backward -------------------------------

SAVING = {
    "nf4": lambda linear: Linear4bit.from_linear(linear, quant_type="nf4"),
    "nf4 nested": lambda linear: Linear4bit.from_linear(linear, quant_type="nf4", compress_statistics=True),
    "fp4": lambda linear: Linear4bit.from_linear(linear, quant_type="fp4"),
    "8bit": lambda linear: Linear8bit.from_linear(linear, blocksize=256),
    "8bit nested": lambda linear: Linear8bit.from_linear(linear, blocksize=256, nested=True),
}


def _saved_storages(fn) -> tuple[object, list[torch.Tensor]]:
    """``fn()``'s result and every tensor autograd saved for its backward."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, saved


def _held(layer: nn.Module, x: torch.Tensor) -> int:
    """The most a backward may keep: the codes, the scales and maps of their state, and the input."""
    return tensor_bytes([layer.weight, *layer.quant_state.tensors()]) + tensor_bytes([x])


@pytest.mark.parametrize("kind", sorted(SAVING))
@pytest.mark.parametrize("rows", [2, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_keeps_the_codes_not_the_decoded_weight(kind, rows, dtype):
    torch.manual_seed(0)
    layer = SAVING[kind](nn.Linear(256, 128))
    layer.bias.requires_grad_(True)
    x = torch.randn(rows, 256, dtype=dtype, requires_grad=True)
    out, saved = _saved_storages(lambda: layer(x))
    assert tensor_bytes(saved) <= _held(layer, x)
    assert tensor_bytes(saved) < 128 * 256 * dtype.itemsize  # the decoded weight
    assert all(tensor.shape != (128, 256) or tensor.dtype == torch.uint8 for tensor in saved)
    out.backward(torch.ones_like(out))
    assert x.grad is not None and layer.bias.grad is not None


@pytest.mark.parametrize("rows", [2, 64])
def test_int8_backward_keeps_the_int8_weight_and_its_scales(rows):
    torch.manual_seed(0)
    layer = LinearInt8.from_linear(nn.Linear(256, 128), threshold=6.0)
    x = torch.randn(rows, 256, requires_grad=True)
    out, saved = _saved_storages(lambda: layer(x))
    assert tensor_bytes(saved) <= tensor_bytes([layer.weight, layer.SCB])
    out.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("kind", sorted(SAVING))
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 64), (2, 1, 3, 64), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_bit_equal_to_a_linear_on_the_decoded_weight(kind, shape, dtype):
    """What the forward computed before it kept only the codes: ``F.linear`` on the decoded weight."""
    torch.manual_seed(0)
    layer = SAVING[kind](nn.Linear(64, 48))
    layer.bias.requires_grad_(True)
    x, grad = torch.randn(shape, dtype=dtype), torch.randn(*shape[:-1], 48, dtype=dtype)
    results = []
    for forward in (layer, lambda x: torch.nn.functional.linear(x, layer.dequantize().to(dtype), layer.bias.to(dtype))):
        inputs = x.clone().requires_grad_(True)
        layer.bias.grad = None
        out = forward(inputs)
        out.backward(grad)
        results.append((out, inputs.grad, layer.bias.grad))
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", sorted(SAVING))
def test_without_gradients_the_forward_is_the_plain_one(kind):
    """More than FEW_TOKENS rows: F.linear on the decoded weight, bit for bit; up to it, the
    few-token kernel (the products summed in another order: float32 rounding apart)."""
    layer = SAVING[kind](nn.Linear(64, 48))
    for rows, exact in ((tightfit.ops.FEW_TOKENS + 1, True), (4, False)):
        x = torch.randn(rows, 64)
        expected = torch.nn.functional.linear(x, layer.dequantize(), layer.bias)
        for context in (torch.no_grad(), torch.inference_mode(), contextlib.nullcontext()):
            with context:
                out, saved = _saved_storages(lambda x=x: layer(x))
            assert out.grad_fn is None and saved == []
            torch.testing.assert_close(out, expected, **({"rtol": 0, "atol": 0} if exact else {}))


def test_a_qlora_forward_leaves_no_decoded_weight_alive():
    """Four frozen NF4 / 8-bit layers with adapters: what the forward leaves alive for the
    backward (counted by tightfit.memory's tracker) is activations, less than one decoded weight."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *(LoRA(SAVING[kind](nn.Linear(256, 256)), 256, 256) for kind in ("nf4", "8bit", "nf4 nested", "fp4"))
    )
    x = torch.randn(8, 256, requires_grad=True)
    with LiveTensorBytes() as tracker:
        out = model(x)
        held = tracker.current
        out.sum().backward()
    assert held < 256 * 256 * 4 // 2
    assert all(layer.A.grad is not None for layer in model)


def test_compiled_backward_keeps_the_codes_not_the_decoded_weight():
    """Under torch.compile the forward's decode and the backward's stay two (the common-
    subexpression pass would merge them and keep the decoded weight alive); no graph break."""
    torch.manual_seed(0)
    layers = [SAVING[kind](nn.Linear(256, 256)) for kind in ("nf4", "8bit", "nf4 nested")]
    model = nn.Sequential(*layers)
    x = torch.randn(16, 256, requires_grad=True)
    eager_out, eager_saved = _saved_storages(lambda: model(x))
    compiled = torch.compile(model, fullgraph=True)
    out, saved = _saved_storages(lambda: compiled(x))
    decoded = [tensor for tensor in saved if tensor.shape == (256, 256) and tensor.is_floating_point()]
    assert decoded == []
    state = [tensor for layer in layers for tensor in layer.quant_state.tensors()]
    held = tensor_bytes([*eager_saved, *state, x])
    assert tensor_bytes(saved) <= held + 256 * 256 // 64 * 4  # a nested state's absmax may be kept decoded
    out.backward(torch.ones_like(out))
    compiled_grad = x.grad.clone()
    x.grad = None
    eager_out.backward(torch.ones_like(eager_out))
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_grad, x.grad, rtol=1e-5, atol=1e-6)


def test_bitsandbytes_compat_layer_keeps_the_codes():
    """``tightfit.compat.bitsandbytes.nn.Linear4bit`` calls ``matmul_4bit``, so it saves the codes too."""
    import tightfit.compat.bitsandbytes as tnb

    torch.manual_seed(0)
    source = nn.Linear(256, 128)
    layer = tnb.nn.Linear4bit(256, 128, quant_type="nf4")
    layer.load_state_dict(source.state_dict())
    layer = layer.to("cpu")
    x = torch.randn(16, 256, requires_grad=True)
    out, saved = _saved_storages(lambda: layer(x))
    state = layer.weight.quant_state
    assert tensor_bytes(saved) <= tensor_bytes([layer.weight.data, *state.tensors(), x]) < 128 * 256 * 4
    out.sum().backward()
    assert x.grad is not None
