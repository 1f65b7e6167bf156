"""Leaves a model pins to full precision (diffusers' ``_keep_in_fp32_modules`` and
``_skip_layerwise_casting_patterns``) keep their dtype in every plan: the planner counts
them as their unit's other tensors, and applying a plan leaves them as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit
from tightfit.fitting.options import find_units
from zoo.lm import figures


class PinnedStack(nn.Module):
    """An embedder pinned by name, then a stack whose blocks each hold a pinned Linear."""

    _keep_in_fp32_modules = ["time_embedder"]
    _skip_layerwise_casting_patterns = [r"\.norm_proj"]

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.time_embedder = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm_proj": nn.Linear(width, width), "ff": nn.Linear(width, width)}) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.time_embedder(x)
        for block in self.blocks:
            x = x + block["ff"](torch.relu(block["norm_proj"](x)))
        return x


def test_pinned_leaves_are_no_units_leaves():
    units = {unit.name: unit for unit in find_units(PinnedStack())}
    assert units["time_embedder"].weights == ()
    assert [name for name, *_ in units["blocks.0"].weights] == ["blocks.0.ff"]
    assert units["blocks.0"].other_bytes == 64 * 64 * 4 + 2 * 64 * 4  # the pinned weight and both biases


@pytest.mark.parametrize(("allow", "share"), [(None, 0.6), ("keep,float8,device", 0.9), ("keep,nf4,device", 0.85)])
def test_a_tight_plan_leaves_pinned_leaves_in_full_precision(allow, share):
    torch.manual_seed(0)
    model, x = PinnedStack(), torch.randn(8, 64)
    full = tightfit.fit(model, (x,), 1 << 40, calibration=figures()).full_peak_bytes
    plan = tightfit.fit(model, (x,), int(full * share), calibration=figures(), allow=allow)
    changed = [leaf for entry in plan.entries if entry.storage != "keep" for leaf in entry.leaves]
    assert changed and not any("time_embedder" in leaf or "norm_proj" in leaf for leaf in changed)
    plan.apply(model)
    modules = dict(model.named_modules())
    pinned = [model.time_embedder, *(block["norm_proj"] for block in model.blocks)]
    assert all(type(leaf) is nn.Linear and leaf.weight.dtype == torch.float32 for leaf in pinned)
    assert all(type(modules[leaf]) is not nn.Linear or modules[leaf].weight.dtype != torch.float32 for leaf in changed)


def tiny_wan() -> nn.Module:
    """diffusers' Wan transformer from a tiny config: its condition embedder is pinned."""
    diffusers = pytest.importorskip("diffusers")
    return diffusers.WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32,
    )  # fmt: skip


def test_diffusers_wan_pins_its_condition_embedder():
    model = tiny_wan()
    units = {unit.name: unit for unit in find_units(model)}
    embedders = [unit for name, unit in units.items() if name.startswith("condition_embedder.")]
    assert len(embedders) == 5 and all(unit.weights == () for unit in embedders)
    assert len(units["blocks.0"].weights) == 10  # attention and feed-forward stay the planner's to choose


def test_a_fitted_diffusers_model_reads_its_compute_dtype_where_float8_is_stored():
    model = tiny_wan()
    from diffusers.models.modeling_utils import get_parameter_dtype

    inputs = {
        "hidden_states": torch.randn(1, 4, 1, 4, 4),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 3, 16),
    }
    full = tightfit.fit(model, inputs, 1 << 40, calibration=figures()).full_peak_bytes
    plan = tightfit.fit(model, inputs, int(full * 0.8), calibration=figures(), allow="keep,float8,device")
    plan.apply(model)
    attention = model.blocks[0].attn1
    assert attention.to_q.weight.dtype == torch.float8_e4m3fn  # stored so, leaf by leaf
    assert get_parameter_dtype(attention) == torch.float32  # what the diffusers code casts activations to
