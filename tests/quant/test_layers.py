"""``layer_stack``: the repeated layers of real and hand-built models."""

from __future__ import annotations

import pytest
from torch import nn

from tightfit.quant import layer_stack


def test_bert_stack_is_its_encoder_layers():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64
    )
    assert layer_stack(transformers.BertModel(config)) == ("encoder.layer.0", "encoder.layer.1", "encoder.layer.2")


def test_the_list_with_most_linear_weights_wins():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(4, 4) for _ in range(5)])
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16)) for _ in range(3)])
            self.mixed = nn.ModuleList([nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64))])  # not one type: no stack

    assert layer_stack(Model()) == ("blocks.0", "blocks.1", "blocks.2")


def test_a_model_that_is_a_list_and_one_without_a_list():
    assert layer_stack(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])) == ("0", "1")
    assert layer_stack(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == ()
    assert layer_stack(nn.ModuleList([nn.Linear(2, 2)])) == ()


def test_bad_input():
    with pytest.raises(TypeError, match="model must be Module"):
        layer_stack("encoder")


def test_the_weighing_decides_which_list_is_the_stack():
    from tightfit.quant.layers import largest_repeated_list

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = nn.ModuleList([nn.LayerNorm(4096) for _ in range(2)])  # many bytes, no Linear
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    model = Model()
    assert layer_stack(model) == ("blocks.0", "blocks.1", "blocks.2")
    by_bytes = largest_repeated_list(model, lambda m: sum(t.nbytes for t in m.parameters()))
    assert by_bytes == ("norms.0", "norms.1")
    assert largest_repeated_list(model, lambda m: 0) == ()
