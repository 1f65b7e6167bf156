"""Units finer than layers (``fit(units="blocks")``): a layer's attention and its
feed-forward network, and in a mixture of experts its experts apart from its router, are
units of their own; the planner moves what saves the bytes at the least time, and the
model computes the same wherever the parts go."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit
from tightfit.fitting.options import UNIT_SIZES, find_units, options_for
from zoo.lm import figures

transformers = pytest.importorskip("transformers")

IDS = torch.arange(3, 19).unsqueeze(0)
KEEP = {"storage": ["keep"]}
LLAMA = dict(
    vocab_size=500,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()


def mixtral() -> torch.nn.Module:
    """A mixture of 4 experts per layer, 2 chosen per token, held stacked (transformers' own layout)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        **{**LLAMA, "intermediate_size": 128}, num_local_experts=4, num_experts_per_tok=2
    )
    return transformers.MixtralForCausalLM(config).eval()


def test_a_layers_blocks_are_its_attention_and_its_feed_forward_network():
    units = find_units(llama(), unit_size="blocks")
    layers = [(unit.name, unit.kind) for unit in units if unit.name.startswith("model.layers.")]
    assert layers == [(f"model.layers.{i}.{part}", "block") for i in range(2) for part in ("self_attn", "mlp")]
    assert [unit.name for unit in units if unit.kind == "rest"] == ["(rest)"]  # the norms
    assert [unit.name for unit in find_units(llama()) if unit.kind == "layer"] == ["model.layers.0", "model.layers.1"]


def test_a_list_of_blocks_gives_a_unit_each():
    # T5's layers hold their self-attention, cross-attention and feed-forward network in a list
    config = transformers.T5Config(vocab_size=500, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16)
    units = find_units(transformers.T5ForConditionalGeneration(config), unit_size="blocks")
    blocks = [unit.name for unit in units if unit.kind == "block"]
    assert blocks == [f"decoder.block.{i}.layer.{j}" for i in range(2) for j in range(3)]


def test_a_mixture_of_experts_moves_its_experts_before_its_attention_and_computes_the_same():
    model = mixtral()
    units = {unit.name: unit.kind for unit in find_units(model, unit_size="blocks")}
    assert units["model.layers.0.mlp.experts"] == "expert" and units["model.layers.0.mlp.gate"] == "block"
    # a token reads 2 of the 4 experts: on disk, a decode step reads half their pages
    assert next(u for u in find_units(model, unit_size="blocks") if u.kind == "expert").active_share == 0.5
    settings = dict(units="blocks", calibration=figures(), decode_steps=16)  # a prompt, then 16 tokens' decode
    full = tightfit.fit(model, {"input_ids": IDS}, 1 << 40, **settings)
    experts = next(e for e in full.entries if e.module == "model.layers.0.mlp.experts").bytes_before
    budget = full.predicted_peak_bytes - experts  # more than the embedding, the head and the attention free
    plan = tightfit.fit(model, {"input_ids": IDS}, budget, allow=KEEP, **settings)
    moved = {e.module for e in plan.entries if e.placement != "device"}
    assert any(name.endswith(".experts") for name in moved)
    assert not any(name.endswith(".self_attn") for name in moved)  # the attention, which every token reads, stays
    with torch.inference_mode():
        unsplit = model(IDS).logits
        plan.apply(model)
        assert torch.equal(model(IDS).logits, unsplit)


def test_a_float32_mixture_of_experts_plans_on_meta_and_the_meta_kernel_is_restored():
    # torch's meta kernel of the experts' grouped matmul takes bfloat16 only; the planner's trace stands in for it
    with torch.device("meta"):
        skeleton = transformers.MixtralForCausalLM(mixtral().config)
    on_meta = tightfit.fit(skeleton.eval(), {"input_ids": IDS.to("meta")}, 1 << 40, calibration=figures())
    on_real = tightfit.fit(mixtral(), {"input_ids": IDS}, 1 << 40, calibration=figures())
    assert on_meta.to_dict() == on_real.to_dict()
    a, b = torch.empty(6, 8, device="meta"), torch.empty(2, 8, 16, device="meta")
    with pytest.raises(RuntimeError, match="BF16"):
        torch._grouped_mm(a, b, offs=torch.empty(2, dtype=torch.int32, device="meta"))


def test_blocks_never_plan_slower_than_layers_and_move_a_feed_forward_network_alone():
    model = llama()
    full = tightfit.fit(model, {"input_ids": IDS}, 1 << 40, calibration=figures())
    split_layers = 0
    for share in [percent / 100 for percent in range(95, 25, -3)]:
        budget = int(full.predicted_peak_bytes * share)
        layers = tightfit.fit(model, {"input_ids": IDS}, budget, calibration=figures(), allow=KEEP)
        blocks = tightfit.fit(model, {"input_ids": IDS}, budget, calibration=figures(), allow=KEEP, units="blocks")
        assert blocks.predicted_peak_bytes <= budget
        assert blocks.predicted_seconds <= layers.predicted_seconds * (1 + 1e-9)  # more choices, never slower
        moved = {e.module for e in blocks.entries if e.placement != "device"}
        split_layers += sum(
            f"model.layers.{i}.mlp" in moved and f"model.layers.{i}.self_attn" not in moved for i in range(2)
        )
    assert split_layers  # where a layer plan moves a whole layer, a block plan may move its feed-forward network only


def test_a_block_plan_streams_in_as_apply_carries_it_out(tmp_path):
    llama().save_pretrained(tmp_path)
    settings = dict(example_inputs={"input_ids": IDS}, calibration=figures(), allow=KEEP, units="blocks")
    full = tightfit.loading.plan_folder(tmp_path, 1 << 40, **settings)[1].full_peak_bytes
    model, plan = tightfit.load(tmp_path, int(full * 0.6), **settings)
    assert any(e.kind == "block" and e.placement == "disk" for e in plan.entries)
    reference = plan.apply(transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval())
    with torch.inference_mode():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
    assert tightfit.fitting.held_bytes(model, "cpu") == plan.predicted_weights_bytes


def test_units_is_checked():
    with pytest.raises(ValueError, match="units='experts' is not accepted; accepted: blocks, layers"):
        tightfit.fit(llama(), {"input_ids": IDS}, 1 << 40, calibration=figures(), units="experts")
    from tightfit.app.run import RunOptions

    with pytest.raises(
        ValueError, match="units=.blocks. is how the fit planner cuts layers into units; it plans only with budget"
    ):
        RunOptions(units="blocks")


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.text(max_size=12), st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2)))
def test_any_other_units_is_refused_naming_it(value):
    if value in UNIT_SIZES:
        return
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises((ValueError, TypeError), match="units"):
        tightfit.fit(model, torch.zeros(1, 4), 1 << 20, calibration=figures(), units=value)


def test_experts_stored_expert_by_expert_are_refused_saying_how_to_save_them(tmp_path):
    # transformers writes Mixtral's experts one by one (the hub's layout) and stacks them while loading
    mixtral().save_pretrained(tmp_path / "original")
    with pytest.raises(ValueError, match="a layout transformers converts while loading.*save_original_format=False"):
        tightfit.load(tmp_path / "original", 1 << 30, example_inputs={"input_ids": IDS}, calibration=figures())
    mixtral().save_pretrained(tmp_path / "stacked", save_original_format=False)
    model, _ = tightfit.load(tmp_path / "stacked", 1 << 30, example_inputs={"input_ids": IDS}, calibration=figures())
    with torch.inference_mode():
        assert torch.equal(model(IDS).logits, mixtral()(IDS).logits)


class _ListedMoE(torch.nn.Module):
    """A router scoring 4 experts held as a list, beside a depthwise convolution (3-D kernels, not experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(16, 16, 4, groups=16)
        self.mix = torch.nn.Linear(16, 16)
        self.gate = torch.nn.Linear(16, 4, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.top_k = 1


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = torch.nn.Sequential(torch.nn.Conv1d(16, 16, 4, groups=16), torch.nn.Linear(16, 16))
        self.moe = _ListedMoE()


def test_experts_are_what_a_router_scores_and_a_token_reads_its_top_k_of_them():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(_Layer() for _ in range(2))
    units = {unit.name: unit for unit in find_units(model, unit_size="blocks")}
    assert units["layers.0.mixer"].kind == "block"  # a convolution whose channels a Linear matches is no expert
    assert [units[f"layers.0.moe.experts.{i}"].kind for i in range(4)] == ["expert"] * 4
    expert = units["layers.0.moe.experts.0"]
    assert expert.active_share == 0.25
    settings = dict(
        storages=frozenset({"keep"}),
        placements=frozenset({"device"}),
        device=torch.device("cpu"),
        rows={name: 1 for name, *_ in expert.weights},
        live={},
        figures=figures(),
    )
    prompt, token = (options_for(expert, one_token=flag, **settings)[0].seconds for flag in (False, True))
    assert token == pytest.approx(prompt / 4)  # a token reads one of the four experts
