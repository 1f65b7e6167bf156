"""What the modules of ``tightfit.compat.bitsandbytes`` share: the NF4 / FP4 shorthands and
``Embedding`` built from the full function take bitsandbytes' parameters in its order;
both parameter classes copy and pickle as themselves; embedding lookups check indices."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch

import tightfit.compat.bitsandbytes as tbnb
from tightfit.compat.bitsandbytes._common import fixed_argument

SHORTHANDS = [
    ("functional", "quantize_nf4"),
    ("functional", "quantize_fp4"),
    ("functional", "dequantize_nf4"),
    ("functional", "dequantize_fp4"),
    ("nn", "LinearNF4"),
    ("nn", "LinearFP4"),
    ("nn", "EmbeddingNF4"),
    ("nn", "EmbeddingFP4"),
    ("nn", "Embedding"),
    ("nn", "StableEmbedding"),
]


@pytest.mark.parametrize(("module", "name"), SHORTHANDS)
def test_signatures_are_bitsandbytes(module, name):
    bnb = pytest.importorskip("bitsandbytes")
    ours = inspect.signature(getattr(getattr(tbnb, module), name))
    theirs = inspect.signature(getattr(getattr(bnb, module), name))
    assert [(p.name, p.default) for p in ours.parameters.values()] == [
        (p.name, p.default) for p in theirs.parameters.values()
    ]


def test_positional_arguments_bind_as_in_bitsandbytes():
    layer = tbnb.nn.LinearNF4(64, 32, False, torch.float32, False, torch.int8)
    weight = layer.to("cpu").weight
    assert (weight.quant_type, weight.quant_storage, weight.compress_statistics, layer.bias) == (
        "nf4",
        torch.int8,
        False,
        None,
    )
    _, state = tbnb.functional.quantize_fp4(torch.randn(8, 64), None, None, 32, True)
    assert (state.quant_type, state.blocksize, state.nested) == ("fp4", 32, True)
    assert tbnb.functional.quantize_nf4.__name__ == "quantize_nf4"


@pytest.mark.parametrize(
    "call",
    [
        lambda: tbnb.nn.LinearNF4(8, 4, quant_type="fp4"),
        lambda: tbnb.functional.dequantize_fp4(torch.zeros(4, 1, dtype=torch.uint8), quant_type="nf4"),
        lambda: tbnb.nn.Embedding(4, 4, dtype=torch.float16),
    ],
)
def test_the_fixed_argument_is_refused(call):
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        call()


def test_fixed_argument_names_the_function():
    def full(a, b=1, kind="x"):
        return (a, b, kind)

    short = fixed_argument(full, "kind", "y", qualname="short")
    assert (short(1, 2), short.__qualname__, list(inspect.signature(short).parameters)) == (
        (1, 2, "y"),
        "short",
        ["a", "b"],
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: tbnb.nn.Int8Params(torch.randn(6, 8), requires_grad=False),
        lambda: tbnb.nn.Params4bit(torch.randn(6, 64)),
    ],
)
def test_parameters_copy_and_pickle_as_themselves(make):
    param = make().cpu()  # quantizes
    shallow = copy.copy(param)
    unpickled = pickle.loads(pickle.dumps(param))
    for other in (shallow, unpickled):
        assert type(other) is type(param)
        assert torch.equal(other.data, param.data)
        assert other._fields().keys() == param._fields().keys()
    assert shallow.data.data_ptr() == param.data.data_ptr()


@pytest.mark.parametrize("make", [lambda: tbnb.nn.Embedding8bit(10, 4), lambda: tbnb.nn.Embedding4bit(10, 64)])
@pytest.mark.parametrize(
    ("indices", "error", "message"),
    [
        (torch.tensor([10]), ValueError, "input holds index 10; accepted: 0 to 9"),
        (torch.tensor([-1]), ValueError, "input holds index -1"),
        (torch.tensor([1.0]), TypeError, "input has dtype torch.float32"),
    ],
)
def test_embedding_lookups_check_indices(make, indices, error, message):
    layer = make().to("cpu")
    with pytest.raises(error, match=message):
        layer(indices)
