"""Code written against ``bitsandbytes.nn`` (4-bit), run with bitsandbytes' module and with
``tightfit.compat.bitsandbytes`` swapped in: the patterns transformers, PEFT and users have
(build on meta and fill from a prequantized state, ``.to()`` quantizes, copies and pickles,
``torch.chunk``, state dicts both ways, QLoRA backward), and damaged checkpoints refused."""

from __future__ import annotations

import copy
import io
import json
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tightfit.compat.bitsandbytes as tnb
import tightfit.quant.fuzz as quant_fuzz
from tightfit.quant import functional as QF
from zoo.peer import PeerCheck, spec_dequantize_4bit

MODULES = ["tightfit", "bitsandbytes"]


def library(name: str):
    """``import bitsandbytes as bnb``, or tightfit's in its place."""
    return tnb if name == "tightfit" else pytest.importorskip("bitsandbytes")


@pytest.fixture(params=MODULES)
def bnb(request):
    return library(request.param)


def same_outputs(ours: torch.Tensor, theirs: torch.Tensor, computed_in: torch.dtype | None = None) -> None:
    """Layers whose decoded weights are equal give the same outputs up to the order of the
    sums: tightfit's few-token kernels add the products in another order than bitsandbytes'
    CPU code, and in float32 where bitsandbytes first rounds the decoded weight to a 16-bit
    input's dtype: within float32 rounding, or for 16-bit outputs a few units in the last
    place of the largest output (the spec, decode then ``F.linear``, is tests/ops' business).
    ``computed_in``: the dtype the layers computed in, where the output was cast from it."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if (computed_in or ours.dtype) == torch.float32:
        torch.testing.assert_close(ours, theirs)
    else:
        scale = float(theirs.abs().max()) if theirs.numel() else 0.0
        torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=2**-6 * scale)


def float_linear(seed: int = 0, in_features: int = 64, out_features: int = 32, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, dtype=dtype)


def quantized(bnb, source: nn.Linear, **options) -> nn.Module:
    """bitsandbytes' documented way: load a float state dict, then ``.to(device)`` quantizes."""
    layer = bnb.nn.Linear4bit(source.in_features, source.out_features, **options)
    layer.load_state_dict(source.state_dict())
    return layer.to("cpu")


def inputs(rows: int = 5, in_features: int = 64, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(rows, in_features).to(dtype)


def stats_of(state_dict: dict) -> tuple[torch.Tensor, dict]:
    """The packed weight and its ``weight.*`` entries without prefix, as transformers passes them."""
    return state_dict["weight"], {k[len("weight.") :]: v for k, v in state_dict.items() if k.startswith("weight.")}


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes: packed codes in a float storage may read as NaN, which torch.equal never matches."""
    return tensor.contiguous().view(torch.uint8)


def decoded(layer: nn.Module) -> torch.Tensor:
    return QF.dequantize_4bit(layer.weight.data, layer.weight.quant_state)


def same_state_dicts(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if key.endswith(("bitsandbytes__nf4", "bitsandbytes__fp4")):  # JSON: same fields, spacing aside
            assert json.loads(bytes(a[key].tolist())) == json.loads(bytes(b[key].tolist())), key
        else:
            assert a[key].dtype == b[key].dtype and torch.equal(raw(a[key]), raw(b[key])), key


# -- the parameter's life: float, then quantized by .to() ---------------------------------------------------


def test_to_quantizes_in_place_and_the_layer_keeps_the_state(bnb):
    layer = bnb.nn.LinearNF4(64, 32)
    weight = layer.weight
    assert isinstance(weight, bnb.nn.Params4bit) and not weight.bnb_quantized and weight.dtype == torch.float32
    assert (weight.blocksize, weight.compress_statistics, weight.quant_type) == (64, True, "nf4")
    assert weight.quant_state is None and layer.quant_state is None and not weight.requires_grad
    layer = layer.to("cpu")
    assert layer.weight is weight and weight.bnb_quantized
    assert weight.dtype == torch.uint8 and weight.shape == (64 * 32 // 2, 1)
    assert layer.quant_state is weight.quant_state and weight.quant_state.nested
    assert weight.module is layer and tuple(weight.quant_state.shape) == (32, 64)
    assert weight.absmax is weight.quant_state.absmax and weight.nested_blocksize == 256
    layer.cpu()  # already quantized: a move, no second quantization
    assert torch.equal(layer.weight, weight.data)


def test_cpu_quantizes_and_unnested_state_has_no_nested_fields(bnb):
    layer = bnb.nn.LinearFP4(64, 32, compress_statistics=False).cpu()
    assert layer.weight.bnb_quantized and layer.weight.quant_state.quant_type == "fp4"
    assert not hasattr(layer.weight, "nested_absmax")


def test_params4bit_rebuilt_from_its_dict_as_transformers_does(bnb):
    layer = bnb.nn.Linear4bit(64, 32, quant_type="nf4")
    value = float_linear().weight.detach()
    rebuilt = bnb.nn.Params4bit(value, requires_grad=False, **layer.weight.__dict__).to("cpu")
    expected, _ = QF.quantize_4bit(value, compress_statistics=True, quant_type="nf4")
    assert rebuilt.bnb_quantized and torch.equal(rebuilt.data, expected)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("compress_statistics", [True, False])
@pytest.mark.parametrize("quant_storage", [torch.uint8, torch.bfloat16])
def test_state_dict_and_outputs_equal_bitsandbytes(quant_type, compress_statistics, quant_storage):
    reference = library("bitsandbytes")
    options = dict(quant_type=quant_type, compress_statistics=compress_statistics, quant_storage=quant_storage)
    ours, theirs = (quantized(bnb, float_linear(), **options) for bnb in (tnb, reference))
    same_state_dicts(ours.state_dict(), theirs.state_dict())
    assert torch.equal(decoded(ours), spec_dequantize_4bit(ours.weight.data, ours.weight.quant_state))
    peer = PeerCheck()
    if peer.decode_agrees(theirs.weight):  # then the layers compute the same (up to the order of the sums)
        with torch.no_grad():
            for x in (inputs(), inputs(dtype=torch.bfloat16), inputs(2, dtype=torch.float16)):
                same_outputs(ours(x), theirs(x))
    peer.settle()


@pytest.mark.parametrize("compute_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_compute_dtype_is_used_and_the_output_has_the_input_dtype(compute_dtype):
    reference = library("bitsandbytes")
    ours, theirs = (quantized(bnb, float_linear(), compute_dtype=compute_dtype) for bnb in (tnb, reference))
    peer = PeerCheck()
    same_decode = peer.decode_agrees(theirs.weight)
    for x in (inputs(dtype=torch.bfloat16), inputs(3)):
        with torch.no_grad():
            y, their_y = ours(x), theirs(x)
        assert y.dtype == x.dtype
        if same_decode:  # then the layers compute the same (up to the order of the sums)
            same_outputs(y, their_y, ours.compute_dtype)
    assert ours.compute_dtype == theirs.compute_dtype and ours.compute_type_is_set
    peer.settle()


# -- filling: from a prequantized state (transformers) and load_state_dict --------------------------


@pytest.mark.parametrize("writer", MODULES)
@pytest.mark.parametrize("reader", MODULES)
def test_built_on_meta_and_filled_from_prequantized(writer, reader):
    source = quantized(library(writer), float_linear(), quant_type="nf4")
    bnb = library(reader)
    with torch.device("meta"):
        layer = bnb.nn.Linear4bit(64, 32, quant_type="nf4")
    data, stats = stats_of(source.state_dict())
    layer.weight = bnb.nn.Params4bit.from_prequantized(
        data=data, quantized_stats=stats, requires_grad=False, device="cpu", module=layer
    )
    layer.bias = nn.Parameter(source.bias.detach().clone())
    assert layer.quant_state is layer.weight.quant_state and layer.weight.bnb_quantized
    assert torch.equal(layer.weight.data, data)
    peer = PeerCheck()
    theirs = [m.weight for m in (source, layer) if type(m).__module__.startswith("bitsandbytes")]
    if all([peer.decode_agrees(weight) for weight in theirs]):  # then the layers' arithmetic must be the same
        with torch.no_grad():
            same_outputs(layer(inputs()), source(inputs()))
    peer.settle()


def test_transformers_bitsandbytes_integration_runs_on_tightfit(monkeypatch):
    """transformers' own loading step and PEFT's dequantize helper, with ``bnb`` pointing at tightfit."""
    hf_bnb = pytest.importorskip("transformers.integrations.bitsandbytes")
    monkeypatch.setattr(hf_bnb, "bnb", tnb, raising=False)
    source = quantized(tnb, float_linear(), quant_type="nf4")
    with torch.device("meta"):
        model = nn.Sequential(tnb.nn.Linear4bit(64, 32, quant_type="nf4"))
    entries = {key: [value] for key, value in source.state_dict().items() if key.startswith("weight")}
    loaded = hf_bnb.Bnb4bitDeserialize(None).convert(entries, model=model, full_layer_name="0.weight")
    model[0].weight = loaded["weight"]
    model[0].bias = nn.Parameter(source.bias.detach().clone())
    assert model[0].quant_state is model[0].weight.quant_state
    with torch.no_grad():
        assert torch.equal(model(inputs()), source(inputs()))
    decoded = hf_bnb.dequantize_bnb_weight(model[0].weight)
    assert torch.equal(decoded, QF.dequantize_4bit(source.weight.data, source.weight.quant_state))


def test_accelerate_fills_a_meta_model_and_quantizes(bnb):
    """accelerate's loader rebuilds the parameter from its ``__dict__`` and moves it, which quantizes."""
    modeling = pytest.importorskip("accelerate.utils.modeling")
    source = float_linear()
    with torch.device("meta"):
        model = nn.Sequential(bnb.nn.Linear4bit(64, 32, quant_type="nf4"))
    for name, value in source.state_dict().items():
        modeling.set_module_tensor_to_device(model, f"0.{name}", "cpu", value=value)
    layer = model[0]
    assert type(layer.weight) is bnb.nn.Params4bit and layer.weight.bnb_quantized
    assert layer.quant_state is layer.weight.quant_state
    with torch.no_grad():
        assert torch.equal(model(inputs()), quantized(bnb, source, quant_type="nf4")(inputs()))


@pytest.mark.parametrize("writer", MODULES)
@pytest.mark.parametrize("on_meta", [True, False])
def test_load_state_dict_strict_takes_bitsandbytes_layout(writer, on_meta):
    source = quantized(library(writer), float_linear(), quant_type="fp4")
    layer = tnb.nn.Linear4bit(64, 32, quant_type="fp4", device="meta" if on_meta else None)
    layer.load_state_dict(source.state_dict(), strict=True)
    assert layer.weight.device.type == "cpu" and layer.weight.bnb_quantized and layer.weight.module is layer
    with torch.no_grad():
        same_outputs(layer(inputs()), source(inputs()))
    same_state_dicts(layer.state_dict(), source.state_dict())


def test_load_state_dict_strict_reports_a_missing_weight_and_changes_nothing():
    layer = quantized(tnb, float_linear(), quant_type="nf4")
    before = layer.state_dict()
    stats = {k: v for k, v in quantized(tnb, float_linear(3)).state_dict().items() if k != "weight"}
    with pytest.raises(RuntimeError, match='Missing key.*"weight"'):
        layer.load_state_dict(stats, strict=True)
    same_state_dicts(layer.state_dict(), before)


def test_a_checkpoint_of_another_shape_is_refused():
    source = quantized(tnb, float_linear(in_features=32), quant_type="nf4")
    layer = tnb.nn.Linear4bit(64, 32, quant_type="nf4")
    with pytest.raises(ValueError, match=r"weight holds a weight of shape \(32, 32\); this layer takes \(32, 64\)"):
        layer.load_state_dict(source.state_dict())


def test_float_state_dict_assigned_on_meta_still_quantizes():
    source = float_linear()
    with torch.device("meta"):
        layer = tnb.nn.Linear4bit(64, 32, quant_type="nf4")
    layer.load_state_dict(source.state_dict(), assign=True)
    assert isinstance(layer.weight, tnb.nn.Params4bit) and layer.weight.module is layer
    layer = layer.to("cpu")
    assert layer.weight.bnb_quantized and layer.quant_state is layer.weight.quant_state


# -- copies, pickles, pieces ------------------------------------------------------------------------------------


def test_deepcopy_copies_the_weight_and_its_state(bnb):
    layer = quantized(bnb, float_linear(), quant_type="nf4")
    clone = copy.deepcopy(layer)
    assert isinstance(clone.weight, bnb.nn.Params4bit) and clone.weight.bnb_quantized
    assert clone.weight.data_ptr() != layer.weight.data_ptr()
    assert clone.weight.quant_state is not layer.weight.quant_state
    with torch.no_grad():
        assert torch.equal(clone(inputs()), layer(inputs()))


def test_deepcopy_keeps_the_links_inside_the_copy():  # bitsandbytes' copy still points to the old layer
    layer = quantized(tnb, float_linear(), quant_type="nf4")
    clone = copy.deepcopy(layer)
    assert clone.weight.module is clone and clone.quant_state is clone.weight.quant_state


def test_copy_shares_data_and_state(bnb):
    weight = quantized(bnb, float_linear()).weight
    shallow = copy.copy(weight)
    assert type(shallow) is type(weight) and shallow.data_ptr() == weight.data_ptr()
    assert shallow.quant_state is weight.quant_state and shallow.bnb_quantized


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickled_layers_still_run(bnb, how):
    layer = quantized(bnb, float_linear(), quant_type="nf4")
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(layer))
    else:
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    assert loaded.weight.quant_state is not None
    with torch.no_grad():
        assert torch.equal(loaded(inputs()), layer(inputs()))


def test_pickled_weight_stays_a_params4bit():  # bitsandbytes' comes back a plain Parameter
    layer = pickle.loads(pickle.dumps(quantized(tnb, float_linear(), quant_type="nf4")))
    assert type(layer.weight) is tnb.nn.Params4bit and layer.weight.module is layer


@pytest.mark.parametrize("split", [lambda w: torch.chunk(w, 2), lambda w: torch.split(w, 256)])
def test_chunk_and_split_give_params4bit_pieces(bnb, split):
    weight = quantized(bnb, float_linear()).weight
    pieces = split(weight)
    assert all(type(piece) is type(weight) and piece.quant_state is weight.quant_state for piece in pieces)
    assert torch.equal(torch.cat([piece.data for piece in pieces]), weight.data)


def test_fix_4bit_weight_quant_state_from_module_after_the_weight_lost_it(bnb):
    layer = quantized(bnb, float_linear(), quant_type="nf4")
    with torch.no_grad():
        expected = layer(inputs())
    layer.weight = nn.Parameter(layer.weight.data, requires_grad=False)  # what FSDP's flattening leaves
    with torch.no_grad():
        assert torch.equal(layer(inputs()), expected)
    assert isinstance(layer.weight, bnb.nn.Params4bit) and layer.weight.quant_state is layer.quant_state


def test_matmul_4bit_at_the_top_level(bnb):
    layer = quantized(bnb, float_linear(), quant_type="nf4")
    x = inputs()
    with torch.no_grad():
        y = bnb.matmul_4bit(x, layer.weight.t(), quant_state=layer.weight.quant_state, bias=layer.bias)
        assert torch.equal(y, layer(x))


# -- casting and bad input (tightfit) ---------------------------------------------------------------------------


def test_casting_a_quantized_layer_keeps_its_codes():
    layer = quantized(tnb, float_linear(), quant_type="nf4", quant_storage=torch.bfloat16)
    codes = layer.weight.data.clone()
    layer = layer.to(torch.float16)
    assert torch.equal(raw(layer.weight.data), raw(codes)) and layer.bias.dtype == torch.float16
    assert layer(inputs(dtype=torch.float16)).dtype == torch.float16
    expected = layer(inputs())
    layer = layer.half().float()
    assert torch.equal(raw(layer.weight.data), raw(codes)) and torch.equal(layer(inputs()), expected)


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: tnb.nn.Linear4bit(64, 32, quant_type="int4"), ValueError, "quant_type='int4' is not accepted"),
        (lambda: tnb.nn.Linear4bit(64, 0), ValueError, "output_features=0 is not accepted"),
        (lambda: tnb.nn.Linear4bit(64.0, 32), TypeError, "input_features must be int"),
        (lambda: tnb.nn.Linear4bit(64, 32, compress_statistics="yes"), TypeError, "compress_statistics must be bool"),
        (lambda: tnb.nn.Linear4bit(64, 32, quant_storage=torch.bool), ValueError, "quant_storage=torch.bool"),
        (lambda: tnb.nn.Linear4bit(64, 32, compute_dtype=torch.int8), ValueError, "compute_dtype=torch.int8"),
        (lambda: tnb.nn.EmbeddingNF4(10, 64, dtype=torch.int32), ValueError, "dtype=torch.int32"),
        (lambda: tnb.nn.Params4bit(torch.ones(4), blocksize=48), ValueError, "blocksize=48 is not accepted"),
        (lambda: tnb.nn.Params4bit([1.0]), TypeError, "data must be Tensor"),
        (lambda: tnb.nn.Params4bit(torch.ones(4, dtype=torch.uint8), True), ValueError, "requires_grad=True"),
    ],
)
def test_bad_arguments_are_refused_by_name(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_bad_inputs_are_refused_before_any_kernel():
    layer = quantized(tnb, float_linear())
    with pytest.raises(ValueError, match=r"x has shape \(3, 63\); accepted: \(\.\.\., 64\)"):
        layer(torch.randn(3, 63))
    with pytest.raises(TypeError, match="x must be Tensor"):
        layer([1.0] * 64)
    table = tnb.nn.EmbeddingNF4(10, 64).to("cpu")
    with pytest.raises(ValueError, match="input holds index 10; accepted: 0 to 9"):
        table(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="input holds index -1"):
        table(torch.tensor([-1]))
    with pytest.raises(TypeError, match="input has dtype torch.float32"):
        table(torch.tensor([1.0]))


def test_forward_before_quantizing_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"not quantized yet: call \.to\(device\)"):
        tnb.nn.Linear4bit(64, 32)(inputs())


def test_meta_weight_cannot_be_quantized():
    layer = tnb.nn.Linear4bit(64, 32, device="meta")
    with pytest.raises(RuntimeError, match="on the meta device and holds no values"):
        layer.to("cpu")


# -- QLoRA: a frozen 4-bit base with trainable adapters ---------------------------------------------------------


class LoRA(nn.Module):
    def __init__(self, base: nn.Module, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        torch.manual_seed(5)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x.to(self.down.weight.dtype))).to(x.dtype)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_qlora_backward_reaches_input_and_adapters_as_bitsandbytes(compute_dtype, rows):
    reference = library("bitsandbytes")
    grads = []
    for bnb in (tnb, reference):
        model = LoRA(quantized(bnb, float_linear(), quant_type="nf4", compute_dtype=compute_dtype))
        x = inputs(rows).requires_grad_()
        model(x).square().sum().backward()
        assert model.base.weight.grad is None and model.base.bias.grad is not None
        grads.append([x.grad, model.down.weight.grad, model.up.weight.grad, model.base.bias.grad])
    # bitsandbytes turns the layer's bias into compute_dtype (so its grad too); tightfit leaves it
    close = dict(rtol=1e-5, atol=1e-6) if compute_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours.float(), theirs.float(), **close)


def test_qlora_adapters_train():
    model = LoRA(quantized(tnb, float_linear(), quant_type="nf4"))
    model.base.bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, target = inputs(16), inputs(16, in_features=32, seed=9)
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0]


# -- embeddings ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ["EmbeddingNF4", "EmbeddingFP4"])
@pytest.mark.parametrize("embedding_dim", [128, 72])  # whole blocks per row (rows decoded alone), or not
def test_embeddings_equal_bitsandbytes(cls, embedding_dim):
    reference = library("bitsandbytes")
    torch.manual_seed(0)
    table = nn.Embedding(50, embedding_dim)
    index = torch.tensor([[0, 7, 49], [3, 3, 12]])
    layers = [getattr(bnb.nn, cls)(50, embedding_dim) for bnb in (tnb, reference)]
    for layer in layers:
        layer.load_state_dict(table.state_dict())
        layer.to("cpu")
        assert layer.weight.bnb_quantized and layer.weight.compress_statistics is None
    ours, theirs = (layer(index) for layer in layers)
    spec = spec_dequantize_4bit(layers[1].weight.data, layers[1].weight.quant_state)
    assert torch.equal(raw(layers[0].weight.data), raw(layers[1].weight.data))
    assert ours.shape == (2, 3, embedding_dim) and torch.equal(ours, spec[index])
    peer = PeerCheck()
    peer.agrees("bitsandbytes' Embedding4bit lookup (its dequantize_4bit)", theirs, spec[index])
    peer.settle()


def test_embedding_state_dict_round_trip():
    torch.manual_seed(0)
    layer = tnb.nn.EmbeddingNF4(50, 128)
    layer.load_state_dict(nn.Embedding(50, 128).state_dict())
    layer = layer.to("cpu")
    with torch.device("meta"):
        copy_of = tnb.nn.EmbeddingNF4(50, 128)
    copy_of.load_state_dict(layer.state_dict(), strict=True)
    index = torch.tensor([1, 2, 40])
    assert torch.equal(copy_of(index), layer(index))


# -- damaged prequantized states (D9) ---------------------------------------------------------------------------


def reference_checkpoint() -> dict:
    return quantized(tnb, float_linear(in_features=37, out_features=7), quant_type="nf4").state_dict()


@settings(max_examples=40, deadline=None)
@given(rng=st.randoms(use_true_random=False), through_load=st.booleans())
def test_damaged_prequantized_stats_are_refused_or_load_as_written(rng, through_load):
    checkpoint = reference_checkpoint()
    damaged = quant_fuzz.apply(checkpoint, quant_fuzz.draw_mutations(rng, checkpoint))
    expected = QF.dequantize_4bit(checkpoint["weight"], QF.QuantState.from_dict(stats_of(checkpoint)[1]))
    try:
        if through_load:
            layer = tnb.nn.Linear4bit(37, 7, quant_type="nf4")
            layer.load_state_dict(damaged, strict=True)
            weight = layer.weight
        else:
            stats = {k[len("weight.") :]: v for k, v in damaged.items() if k.startswith("weight.")}
            weight = tnb.nn.Params4bit.from_prequantized(damaged.get("weight"), stats, device="cpu")
    except (ValueError, TypeError):
        return
    except RuntimeError as error:  # torch's report of missing or unexpected keys under strict=True
        assert through_load and "Error(s) in loading state_dict" in str(error), error
        return
    torch.testing.assert_close(QF.dequantize_4bit(weight.data, weight.quant_state), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda s: s.pop("absmax"), ValueError, "quantized_stats: quant state is missing"),
        (lambda s: s.update(absmax=s["absmax"][:-1]), ValueError, "quantized_stats: absmax has shape"),
        (lambda s: s.update(extra=torch.ones(1)), ValueError, "extra is not a quant state entry"),
        (lambda s: s.update(quant_map=s["quant_map"] * 2), ValueError, "is not the nf4 table"),
    ],
)
def test_bad_quantized_stats_name_the_argument(change, error, match):
    data, stats = stats_of(quantized(tnb, float_linear(), quant_type="nf4", compress_statistics=False).state_dict())
    change(stats)
    with pytest.raises(error, match=match):
        tnb.nn.Params4bit.from_prequantized(data, stats, device="cpu")


def test_packed_data_of_the_wrong_size_is_refused():
    data, stats = stats_of(quantized(tnb, float_linear(), quant_type="nf4").state_dict())
    with pytest.raises(ValueError, match="data holds 1023 packed bytes but shape"):
        tnb.nn.Params4bit.from_prequantized(data[:-1], stats, device="cpu")
    with pytest.raises(TypeError, match="quantized_stats must be dict"):
        tnb.nn.Params4bit.from_prequantized(data, list(stats.values()), device="cpu")


def test_compiled_equals_eager_in_bfloat16_with_bias_at_batch_one():
    """bitsandbytes' own test_linear4bit_torch_compile (one token, bf16, a float32 bias), bit
    for bit: bitsandbytes itself rounds the bias to bf16 first and only meets its tolerance."""
    torch.manual_seed(0)
    layer = tnb.nn.Linear4bit(256, 256, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4").to("cpu")
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    torch.compiler.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))
