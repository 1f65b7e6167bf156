"""Code written against ``bitsandbytes.nn``'s 8-bit layers and ``bitsandbytes.matmul``,
run with bitsandbytes (where installed) and with ``tightfit.compat.bitsandbytes`` swapped
in; then the two against each other on the CPU, and bad checkpoint entries."""

from __future__ import annotations

import copy
import importlib.util
import io
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit.compat.bitsandbytes as tbnb
from tightfit import ops

BACKENDS = ["tightfit"] + (["bitsandbytes"] if importlib.util.find_spec("bitsandbytes") else [])


@pytest.fixture(params=BACKENDS)
def bnb(request):
    """The module the code under test imports as ``bnb``."""
    if request.param == "tightfit":
        return tbnb
    return pytest.importorskip("bitsandbytes")


def float_linear(seed: int = 0, in_features: int = 64, out_features: int = 48) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features)


def quantized(bnb, linear: torch.nn.Linear, threshold: float = 0.0):
    """The pattern of bitsandbytes' docs: build, load the float weights, ``.to()`` quantizes."""
    layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, has_fp16_weights=False, threshold=threshold)
    layer.load_state_dict(linear.state_dict())
    return layer.to("cpu")


def inputs(rows: int = 5, features: int = 64, dtype: torch.dtype = torch.float16, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=generator).to(dtype)


def scales_of(layer) -> torch.Tensor:
    """bitsandbytes moves SCB from the weight to ``layer.state`` at the first call."""
    return layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB


# -- the usage patterns, with either module ---------------------------------------------------


def test_to_quantizes_and_state_holds_the_int8_weight(bnb):
    linear = float_linear()
    layer = bnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False)
    layer.load_state_dict(linear.state_dict())
    assert layer.weight.dtype == torch.float32 and isinstance(layer.weight, bnb.nn.Int8Params)
    layer = layer.to("cpu")
    assert layer.weight.dtype == torch.int8 and not layer.weight.requires_grad
    assert layer.weight.SCB.dtype == torch.float32 and layer.weight.SCB.shape == (48,)
    layer(inputs())
    assert torch.equal(layer.state.CB, layer.weight.data) and torch.equal(scales_of(layer), layer.state.SCB)
    assert layer.state.has_fp16_weights is False and layer.state.threshold == 0.0
    dequantized = layer.state.CB.float() * layer.state.SCB[:, None] / 127
    assert (dequantized - linear.weight).abs().max() <= linear.weight.abs().max() / 127


def test_state_dict_layout_and_strict_round_trip(bnb):
    layer = quantized(bnb, float_linear())
    state = layer.state_dict()
    assert set(state) == {"weight", "bias", "SCB", "weight_format"}
    assert state["weight"].dtype == torch.int8 and state["SCB"].dtype == torch.float32
    assert state["weight_format"].dtype == torch.uint8 and int(state["weight_format"]) == 0
    fresh = bnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False).to("cpu")  # bitsandbytes needs it quantized first
    fresh.load_state_dict(state, strict=True)
    x = inputs()
    layer.eval(), fresh.eval()
    assert torch.equal(fresh(x), layer(x))


def test_half_keeps_the_layer_working(bnb):
    layer = quantized(bnb, float_linear()).eval()
    x = inputs()
    before = layer(x)
    layer.half()
    assert layer.weight.dtype == torch.int8 and scales_of(layer).dtype == torch.float32
    assert torch.equal(layer(x), before)


def test_deepcopy_and_pickle_keep_the_quantized_weight(bnb):
    layer = quantized(bnb, float_linear()).eval()
    x = inputs()
    expected = layer(x)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert copied.weight.dtype == torch.int8 and torch.equal(copied.weight, layer.weight)
        assert torch.equal(copied(x), expected)
        assert copied.weight.data_ptr() != layer.weight.data_ptr()


def test_torch_save_round_trip_of_the_whole_model(bnb):
    model = torch.nn.Sequential(quantized(bnb, float_linear()), torch.nn.ReLU()).eval()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = inputs()
    assert torch.equal(loaded(x), model(x))


def test_backward_reaches_the_input_and_a_trainable_adapter(bnb):
    """QLoRA's pattern: a frozen 8-bit base plus a trainable low-rank adapter."""
    linear = float_linear()
    base = quantized(bnb, linear)
    torch.manual_seed(2)
    down, up = torch.nn.Linear(64, 4, bias=False), torch.nn.Linear(4, 48, bias=False)
    x = inputs(dtype=torch.float32).requires_grad_()
    weight = torch.randn(5, 48)
    ((base(x) + up(down(x))) * weight).sum().backward()
    assert down.weight.grad is not None and up.weight.grad is not None
    assert base.weight.grad is None
    dequantized = base.state.CB.float() * base.state.SCB[:, None] / 127
    expected = weight @ dequantized + (weight @ up.weight) @ down.weight
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)


def test_bias_trains_and_fp16_weights_get_their_gradient(bnb):
    """has_fp16_weights=True (the default): the weight stays float, trainable, and is
    quantized at every call."""
    linear = float_linear()
    layer = bnb.nn.Linear8bitLt(64, 48)
    layer.load_state_dict(linear.state_dict())
    layer = layer.to("cpu")
    assert layer.weight.dtype == torch.float32 and layer.weight.requires_grad
    x = inputs(dtype=torch.float32)
    grad = torch.randn(5, 48)
    (layer(x) * grad).sum().backward()
    torch.testing.assert_close(layer.weight.grad, grad.t() @ x)
    torch.testing.assert_close(layer.bias.grad, grad.sum(0))
    assert layer.state.CB.dtype == torch.int8


@pytest.mark.parametrize("shape", [(2, 3, 64), (0, 64), (2, 0, 64)])
def test_batched_and_empty_inputs(bnb, shape):
    layer = quantized(bnb, float_linear(), threshold=6.0)
    x = torch.randn(shape, requires_grad=True)
    out = layer(x)
    assert out.shape == (*shape[:-1], 48)
    out.sum().backward()
    assert x.grad.shape == shape


def test_transformers_loading_and_dequantizing_patterns(bnb):
    """What transformers' bitsandbytes integration does: rebuild the parameter from the
    old one's ``__dict__`` plus the checkpoint's SCB, move it (quantized data stays), set
    it on a layer built on meta, run; dequantize from ``state.SCB`` (or ``weight.SCB``)."""
    saved = quantized(bnb, float_linear()).state_dict()
    with torch.device("meta"):
        layer = bnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False)
    kwargs = dict(layer.weight.__dict__)
    kwargs["SCB"] = saved["SCB"]
    layer.weight = bnb.nn.Int8Params(saved["weight"], requires_grad=False, **kwargs).to("cpu")
    layer.bias = torch.nn.Parameter(saved["bias"])
    out = layer.eval()(inputs())
    assert out.shape == (5, 48) and torch.equal(layer.state.CB, saved["weight"])
    float_weight = bnb.nn.Int8Params(float_linear().weight.detach(), requires_grad=False, **kwargs).to("cpu")
    assert float_weight.dtype == torch.int8 and torch.equal(float_weight.data, saved["weight"])
    state = bnb.MatmulLtState()
    if state.SCB is None:
        state.SCB = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
    dequantized = bnb.functional.int8_vectorwise_dequant(layer.weight.data, state.SCB)
    assert (dequantized - float_linear().weight).abs().max() <= float_linear().weight.abs().max() / 127


def test_threshold_sends_outlier_columns_through_in_float(bnb):
    linear = float_linear()
    layer = quantized(bnb, linear, threshold=6.0).eval()
    x = inputs(dtype=torch.float16)
    x[:, 7] = 40.0  # one outlier column
    exact = torch.nn.functional.linear(x.float(), linear.weight, linear.bias)
    with_outliers = layer(x).float()
    without = quantized(bnb, linear).eval()(x).float()
    # the outlier column no longer inflates every row's scale
    assert (with_outliers - exact).abs().max() < (without - exact).abs().max() / 4


def test_matmul_with_a_state(bnb):
    linear = float_linear()
    x = inputs(dtype=torch.float16)
    state = bnb.MatmulLtState()
    state.has_fp16_weights = False
    state.is_training = False
    out = bnb.matmul(x, linear.weight.detach().half(), state=state, bias=linear.bias.detach().half())
    assert state.CB.dtype == torch.int8 and state.SCB.dtype == torch.float32
    assert out.dtype == torch.float16 and out.shape == (5, 48)
    torch.testing.assert_close(
        out.float(), torch.nn.functional.linear(x.float(), linear.weight, linear.bias), atol=0.05, rtol=0
    )
    again = bnb.matmul(x, linear.weight.detach().half(), state=state, bias=linear.bias.detach().half())
    assert torch.equal(again, out)  # the quantized weight in the state is reused


def test_embedding8bit_quantizes_on_to(bnb):
    torch.manual_seed(3)
    table = torch.nn.Embedding(32, 16)
    layer = bnb.nn.Embedding8bit(32, 16)
    layer.load_state_dict(table.state_dict())
    layer = layer.to("cpu")
    assert layer.weight.dtype == torch.int8
    index = torch.tensor([[0, 5, 31], [2, 2, 7]])
    out = layer(index)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 16)
    assert (out - table(index)).abs().max() <= table.weight.abs().max() / 127


@pytest.mark.parametrize("name", ["Embedding", "StableEmbedding"])
def test_float_embeddings_init_xavier_and_pad_with_zeros(bnb, name):
    torch.manual_seed(9)
    layer = getattr(bnb.nn, name)(50, 16, padding_idx=3)
    assert torch.equal(layer.weight[3].detach(), torch.zeros(16))
    bound = (6 / (50 + 16)) ** 0.5  # Xavier-uniform
    weight = layer.weight.detach()
    assert float(weight.abs().max()) <= bound and float(weight.std()) > bound / 3
    index = torch.tensor([[1, 3, 49]])
    out = layer(index)
    assert out.shape == (1, 3, 16)
    if name == "StableEmbedding":
        assert set(layer.state_dict()) == {"weight", "norm.weight", "norm.bias"}
        torch.testing.assert_close(out.mean(-1), torch.zeros(1, 3), atol=1e-5, rtol=0)


# -- tightfit against bitsandbytes on the CPU ---------------------------------------------------


@pytest.fixture
def real():
    return pytest.importorskip("bitsandbytes")


def test_quantized_weights_are_bit_equal(real):
    """Both quantize from the weight's float16 copy: same codes and scales, so a checkpoint
    from either is the other's."""
    linear = float_linear()
    ours, theirs = quantized(tbnb, linear), quantized(real, linear)
    assert torch.equal(ours.weight.data, theirs.weight.data)
    assert torch.equal(ours.weight.SCB, theirs.weight.SCB)


@pytest.mark.parametrize("direction", ["bitsandbytes->tightfit", "tightfit->bitsandbytes"])
def test_checkpoints_load_both_ways_strict(real, direction):
    source, target = (real, tbnb) if direction.startswith("bits") else (tbnb, real)
    saved = quantized(source, float_linear(seed=4)).state_dict()
    layer = target.nn.Linear8bitLt(64, 48, has_fp16_weights=False).to("cpu")
    layer.load_state_dict(saved, strict=True)
    assert torch.equal(layer.weight.data, saved["weight"]) and torch.equal(scales_of(layer), saved["SCB"])


def test_tightfit_loads_an_int8_checkpoint_before_to(real):
    """bitsandbytes refuses this (RuntimeError: call .cuda() first); the int8 weight and
    its scales are taken as they are."""
    saved = quantized(real, float_linear()).state_dict()
    layer = tbnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False)
    layer.load_state_dict(saved, strict=True)
    assert layer.weight.dtype == torch.int8 and torch.equal(layer.state.SCB, saved["SCB"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threshold", [0.0, 6.0])
def test_eval_outputs_in_half_precision_are_bit_equal(real, threshold, dtype):
    """In eval both quantize the input per row (bitsandbytes from its float16 copy, exact
    for float16 and for bfloat16 in float16's range), multiply in int8 (exact) and scale
    back with the same float32 formula; outlier columns are added in the input's dtype alike."""
    linear = float_linear()
    ours, theirs = quantized(tbnb, linear, threshold).eval(), quantized(real, linear, threshold).eval()
    x = inputs(rows=7, dtype=dtype)
    x[2, 11] = -20.0
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize(
    ("dtype", "mode"),
    [(torch.float32, "eval"), (torch.float32, "train"), (torch.float16, "train"), (torch.bfloat16, "train")],
)
def test_outputs_are_close_elsewhere(real, dtype, mode):
    """Where they differ, on purpose: bitsandbytes casts a float32 input to float16 before
    quantizing it (tightfit quantizes it in its own dtype), and in training on the CPU it
    multiplies by the dequantized weight (tightfit stays int8 and honours the threshold).
    The gap is the input's int8 rounding: at most max|x| / 254 per element, times the
    summed |weight| of an output. Measured (64 rows, 64 -> 48, outputs up to 2.2): 5.1e-3
    in eval (float32), 1.3e-2 to 1.6e-2 in training; against the float product tightfit's
    largest error is 1.5e-2, bitsandbytes' 1.4e-2 (eval) and 8.7e-3 (training)."""
    linear = float_linear()
    ours, theirs = quantized(tbnb, linear), quantized(real, linear)
    getattr(ours, mode)(), getattr(theirs, mode)()
    x = inputs(rows=6, dtype=dtype)
    a, b = ours(x).float(), theirs(x).float()
    deq = ours.state.CB.float() * ours.state.SCB[:, None] / 127
    bound = x.float().abs().amax(1, keepdim=True) / 254 * deq.abs().sum(1) + 1e-2 * b.abs() + 1e-3
    assert bool(((a - b).abs() <= bound).all()), (a - b).abs().max()


def test_input_gradients_match_bitsandbytes(real):
    linear = float_linear()
    grads = []
    for module in (tbnb, real):
        layer = quantized(module, linear)
        x = inputs(dtype=torch.float32).requires_grad_()
        (layer(x) * torch.arange(48.0)).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def test_embeddings_are_bit_equal(real):
    torch.manual_seed(5)
    table = torch.nn.Embedding(40, 24)
    layers = []
    for module in (tbnb, real):
        layer = module.nn.Embedding8bit(40, 24)
        layer.load_state_dict(table.state_dict())
        layers.append(layer.to("cpu"))
    index = torch.randint(0, 40, (3, 9))
    assert torch.equal(layers[0](index), layers[1](index))


def test_matmul_eval_float16_is_bit_equal(real):
    linear = float_linear()
    x = inputs(dtype=torch.float16)
    outs = []
    for module in (tbnb, real):
        state = module.MatmulLtState()
        state.is_training = False
        outs.append(module.matmul(x, linear.weight.detach().half(), state=state, threshold=6.0))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("name", ["Embedding", "StableEmbedding"])
def test_float_embeddings_are_bitsandbytes_own(real, name):
    """Same seed, same initialization and output; state dicts load both ways (strict)."""
    layers = []
    for module in (tbnb, real):
        torch.manual_seed(10)
        layers.append(getattr(module.nn, name)(30, 12, padding_idx=0))
    index = torch.randint(0, 30, (4, 5))
    assert torch.equal(layers[0](index), layers[1](index))
    layers[0].load_state_dict(layers[1].state_dict(), strict=True)
    layers[1].load_state_dict(layers[0].state_dict(), strict=True)


# -- tightfit only: what it adds, and what it refuses -----------------------------------------


def test_int8_codes_convert_to_numbers():
    weight = quantized(tbnb, float_linear()).weight
    numbers = weight.to(torch.int32)
    assert type(numbers) is torch.Tensor and numbers.dtype == torch.int32 and torch.equal(numbers, weight.data.int())


def test_a_plain_parameter_set_by_hand_is_quantized_at_the_first_call():
    linear = float_linear()
    layer = tbnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False)
    layer.weight = torch.nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
    layer(inputs())
    assert isinstance(layer.weight, tbnb.nn.Int8Params)
    assert torch.equal(layer.weight.data, quantized(tbnb, linear).weight.data)
    layer.weight = torch.nn.Parameter(layer.weight.data.clone(), requires_grad=False)  # int8 without its scales
    with pytest.raises(ValueError, match="row scales"):
        layer(inputs())


def test_embedding8bit_state_dict_round_trip():
    torch.manual_seed(6)
    layer = tbnb.nn.Embedding8bit(10, 8)
    layer = layer.to("cpu")
    state = layer.state_dict()
    assert set(state) == {"weight", "SCB"}
    fresh = tbnb.nn.Embedding8bit(10, 8)
    fresh.load_state_dict(state, strict=True)
    index = torch.arange(10)
    assert torch.equal(fresh(index), layer(index))


def test_an_unquantized_embedding_refuses_to_run():
    with pytest.raises(RuntimeError, match="not quantized yet"):
        tbnb.nn.Embedding8bit(4, 4)(torch.tensor([1]))


def test_meta_built_layer_is_filled_by_load_state_dict():
    saved = quantized(tbnb, float_linear()).state_dict()
    with torch.device("meta"):
        layer = tbnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False)
    layer.load_state_dict(saved, strict=True, assign=True)
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.int8
    assert layer(inputs()).shape == (5, 48)


def test_strict_loading_reports_a_missing_weight():
    layer = tbnb.nn.Linear8bitLt(64, 48, has_fp16_weights=False).to("cpu")
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "weight"'):
        layer.load_state_dict({"bias": torch.zeros(48)}, strict=True)
    result = layer.load_state_dict({"bias": torch.zeros(48)}, strict=False)
    assert result.missing_keys == ["weight"]


def test_int8_checkpoint_into_an_fp16_weights_layer_is_refused():
    saved = quantized(tbnb, float_linear()).state_dict()
    with pytest.raises(ValueError, match="has_fp16_weights=True"):
        tbnb.nn.Linear8bitLt(64, 48).load_state_dict(saved)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"threshold": -1.0}, ValueError, "threshold"),
        ({"threshold": float("nan")}, ValueError, "threshold"),
        ({"has_fp16_weights": 1}, TypeError, "has_fp16_weights"),
        ({"bias": "yes"}, TypeError, "bias"),
        ({"input_features": -3}, ValueError, "input_features"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    arguments = {"input_features": 8, "output_features": 4, **kwargs}
    with pytest.raises(error, match=match):
        tbnb.nn.Linear8bitLt(**arguments)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"padding_idx": 7}, ValueError, "padding_idx=7"),
        ({"padding_idx": 1.0}, TypeError, "padding_idx"),
        ({"num_embeddings": 2.5}, TypeError, "num_embeddings"),
        ({"_weight": torch.zeros(3, 3)}, ValueError, "_weight"),
    ],
)
def test_bad_embedding_arguments(kwargs, error, match):
    arguments = {"num_embeddings": 7, "embedding_dim": 4, **kwargs}
    with pytest.raises(error, match=match):
        tbnb.nn.StableEmbedding(**arguments)


def test_bad_matmul_arguments():
    weight = torch.randn(4, 8)
    with pytest.raises(TypeError, match="state"):
        tbnb.matmul(torch.randn(2, 8), weight, state={"CB": None})
    with pytest.raises(ValueError, match="threshold"):
        tbnb.matmul(torch.randn(2, 8), weight, threshold=-1)
    with pytest.raises(ValueError, match="SCB"):
        tbnb.matmul(torch.randn(2, 8), weight.to(torch.int8))
    with pytest.raises(ValueError, match="float16's range"):
        tbnb.matmul(torch.randn(2, 8), torch.full((4, 8), 1e6))
    with pytest.raises(ValueError, match="out must be"):
        tbnb.matmul(torch.randn(2, 8), weight, out=torch.empty(3, 4))
    out = torch.empty(2, 4)
    assert tbnb.matmul(torch.randn(2, 8), weight, out=out) is out


def test_bad_inputs_to_the_layer():
    layer = quantized(tbnb, float_linear())
    with pytest.raises(ValueError, match="64"):
        layer(torch.randn(2, 63))
    with pytest.raises(TypeError, match="x has dtype"):
        layer(torch.ones(2, 64, dtype=torch.int64))


def test_the_op_behind_the_layer_is_int8_linear():
    layer = quantized(tbnb, float_linear(), threshold=6.0).eval()
    x = inputs(dtype=torch.float32)
    expected = ops.int8_linear(x, layer.weight.data, layer.weight.SCB, layer.bias, 6.0)
    assert torch.equal(layer(x), expected)


# -- checkpoint entries are input from outside (D9) ----------------------------------------------

_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.float16, torch.float32, torch.float64, torch.bool]


@st.composite
def tensors(draw, shapes, dtypes, special=True):
    shape = draw(st.sampled_from(shapes))
    dtype = draw(st.sampled_from(dtypes))
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype)
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) * 10
        if special and values.numel() and draw(st.booleans()):
            values.view(-1)[0] = draw(st.sampled_from([float("nan"), float("inf"), -1.0, -0.0, 1e38]))
        return values.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -200), min(info.max, 200) + 1, shape, dtype=dtype)


@st.composite
def entries(draw):
    """Each entry valid (most often, so that loads also succeed), damaged or absent."""
    as_int8 = draw(st.booleans())
    choices = {
        "weight": (
            st.builds(lambda: torch.randint(-127, 128, (4, 8), dtype=torch.int8))
            if as_int8
            else st.builds(lambda: torch.randn(4, 8)),
            st.one_of(
                tensors([(4, 8), (8, 4), (4, 7), (32,), (0, 8)], _DTYPES),
                st.sampled_from(["weight", 3, [[1, 2]], torch.zeros(4, 8, device="meta")]),
            ),
        ),
        "SCB": (
            st.builds(lambda: torch.rand(4) + 0.1) if as_int8 else st.none(),
            st.one_of(tensors([(4,), (8,), (4, 1), ()], _DTYPES), st.sampled_from([1.0, "SCB"])),
        ),
        "weight_format": (
            st.sampled_from([None, torch.tensor(0, dtype=torch.uint8), "row", 0]),
            st.sampled_from([torch.tensor(1), torch.tensor([0, 0]), torch.tensor(0.5), "col32", 2, True]),
        ),
        "bias": (
            st.builds(lambda: torch.randn(4)),
            st.one_of(tensors([(4,), (8,)], _DTYPES, special=False), st.just("bias")),
        ),
    }
    state = {}
    for key, (valid, damaged) in choices.items():
        kind = draw(st.sampled_from(["valid"] * 6 + ["damaged", "absent"]))
        value = None if kind == "absent" else draw(valid if kind == "valid" else damaged)
        if value is not None:
            state[key] = value
    return state


def _layer(kind: str, quantize_first: bool):
    layer = tbnb.nn.Linear8bitLt(8, 4, has_fp16_weights=False) if kind == "linear" else tbnb.nn.Embedding8bit(4, 8)
    return layer.to("cpu") if quantize_first else layer


def _run(layer, kind: str) -> torch.Tensor:
    return layer(torch.randn(3, 8)) if kind == "linear" else layer(torch.tensor([0, 3, 1]))


@settings(max_examples=150, deadline=None)
@given(
    state=entries(), kind=st.sampled_from(["linear", "embedding"]), quantize_first=st.booleans(), strict=st.booleans()
)
def test_bad_state_dict_entries_raise_cleanly_and_leave_the_layer_unchanged(state, kind, quantize_first, strict):
    layer = _layer(kind, quantize_first)
    before = {key: value.clone() for key, value in layer.state_dict().items()}
    try:
        layer.load_state_dict(state, strict=strict)
    except (ValueError, TypeError):
        after = layer.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        return
    except RuntimeError as error:  # torch's own report of missing or unexpected keys (strict)
        assert strict and ("Missing key" in str(error) or "Unexpected key" in str(error)), error
        return
    if layer.weight.dtype != torch.int8 and not bool(torch.isfinite(layer.weight).all()):
        with pytest.raises(ValueError, match="NaN, inf or values past float16's range"):
            layer.to("cpu")  # torch's loading takes any float weight; quantizing it refuses
        return
    layer = layer.to("cpu")
    assert _run(layer, kind).shape == (3, 4 if kind == "linear" else 8)
    assert layer.weight.dtype == torch.int8 and bool(torch.isfinite(layer.weight.SCB).all())


@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_float_weights_into_a_quantized_layer_are_quantized(kind):
    torch.manual_seed(8)
    float_state = {"weight": torch.randn(4, 8)} | ({"bias": torch.zeros(4)} if kind == "linear" else {})
    layer = _layer(kind, quantize_first=True)
    layer.load_state_dict(float_state, strict=True)
    expected = _layer(kind, quantize_first=False)
    expected.load_state_dict(float_state, strict=True)
    expected = expected.to("cpu")
    assert layer.weight.dtype == torch.int8 and torch.equal(layer.weight.data, expected.weight.data)
    assert torch.equal(layer.weight.SCB, expected.weight.SCB)
