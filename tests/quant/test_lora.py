"""LoRA adapters beside frozen Linears: the adapted model starts equal to the base, only the
adapters train, the base stays a Linear leaf a storage can compact; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tightfit.quant import LoRALinear, add_lora, storage_format


def stack() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)) for _ in range(2))
    model.head = nn.Linear(64, 8)
    model.forward = lambda x: model.head(model.layers[1](model.layers[0](x)))
    return model


def test_adapters_start_at_the_base_and_alone_train():
    model = stack()
    x = torch.randn(4, 64)
    before = model(x)
    names = add_lora(model, rank=4)
    assert names == ["layers.0.0", "layers.0.2", "layers.1.0", "layers.1.2"]  # the stack, not the head
    assert torch.equal(model(x), before)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in name for name in trained)
    model(x).sum().backward()
    assert model.layers[0][0].lora_A.weight.grad is not None and model.layers[0][0].base.weight.grad is None


def test_the_base_stays_a_leaf_a_storage_compacts():
    model = stack()
    add_lora(model, rank=4, targets=r"layers\.0\.0$")
    storage_format("nf4").apply(model, frozenset({"layers.0.0.base"}))
    layer = model.layers[0][0]
    assert isinstance(layer, LoRALinear) and type(layer.base).__name__ == "Linear4bit"
    assert layer.in_features == 64 and layer.out_features == 128
    model(torch.randn(2, 64)).sum().backward()
    assert layer.lora_B.weight.grad is not None


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(rank=0), ValueError, "rank"),
        (dict(alpha=0), ValueError, "alpha must be a finite number > 0"),
        (dict(targets="("), ValueError, r"targets='\(' is not a regular expression"),
        (dict(targets="nothing"), ValueError, "has no nn.Linear whose name 'nothing' finds"),
        (dict(targets=3), TypeError, "targets"),
    ],
)
def test_bad_arguments_are_refused_before_anything_changes(kwargs, error, words):
    model = stack()
    with pytest.raises(error, match=words):
        add_lora(model, **kwargs)
    assert all(p.requires_grad for p in model.parameters())


def test_adapting_again_or_the_model_itself_is_refused():
    model = stack()
    add_lora(model, rank=4)
    with pytest.raises(ValueError, match="adapted already are left as they are"):
        add_lora(model, rank=4)
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 4
    with pytest.raises(ValueError, match="has no nn.Linear whose name '' finds"):
        add_lora(nn.Linear(4, 4), targets="")
