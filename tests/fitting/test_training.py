"""The training fit (``fit(..., training=True)``): a training step's peak predicted within 5%
of the measured one (full fine-tune and QLoRA), every plan within its budget, the choices
it makes as the budget shrinks, and bad arguments refused naming what is wrong."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import tightfit
from tightfit.fitting.training import training_storages
from tightfit.fitting.training_plan import TrainingPlan
from tightfit.memory import measure_training_step
from zoo.lm import figures

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    use_cache=False,
)
IDS = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(0))
INPUTS = {"input_ids": IDS, "labels": IDS}  # the loss is the output the backward starts from


class LoRA(nn.Module):
    """A frozen ``base`` plus a trainable rank-8 adapter, as PEFT's LoRA layers."""

    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * 2.0


def llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def adapted() -> nn.Module:
    """The Llama frozen, each decoder Linear with an adapter beside it (QLoRA's shape)."""
    model = llama().requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRA(child))
    return model


def plan_for(model: nn.Module, budget: int | str, **extra) -> TrainingPlan:
    return tightfit.fit(model, INPUTS, budget, training=True, calibration=figures(), **extra)


def measured_peak(model: nn.Module, plan: TrainingPlan) -> int:
    """The measured peak of a training step of ``model`` with ``plan`` applied (a copy): the
    allocator's (the live-tensor count runs under a dispatch mode, which makes autograd
    sum gradients out of place, a copy eager PyTorch does not make)."""
    applied = plan.apply(copy.deepcopy(model))
    optimizer = plan.make_optimizer(applied.parameters(), lr=1e-3)
    measured, losses = measure_training_step(applied, (), INPUTS, optimizer, "cpu")
    assert len(losses) == 2 and all(loss == loss for loss in losses)  # not NaN
    return measured.allocated_peak_bytes


@pytest.fixture(scope="module")
def full_fine_tune() -> tuple[nn.Module, TrainingPlan]:
    model = llama()
    return model, plan_for(model, 1 << 40)


def test_the_unplanned_step_is_predicted_within_5_percent(full_fine_tune):
    model, plan = full_fine_tune
    assert not plan.activations and plan.optim_bits == 32 and not plan.changed_entries()
    assert plan.predicted_peak_bytes == plan.full_peak_bytes
    measured = measured_peak(model, plan)
    assert abs(measured / plan.predicted_peak_bytes - 1) < 0.05, (measured, plan.predicted_peak_bytes)


@pytest.mark.parametrize("share", [0.75, 0.6])
def test_a_full_fine_tune_within_a_smaller_budget_meets_it_as_predicted(full_fine_tune, share):
    model, unplanned = full_fine_tune
    budget = int(unplanned.full_peak_bytes * share)
    plan = plan_for(model, budget)
    assert plan.predicted_peak_bytes <= budget
    assert plan.activations or plan.optim_bits == 8  # something had to give
    measured = measured_peak(model, plan)
    assert abs(measured / plan.predicted_peak_bytes - 1) < 0.05, (measured, plan.predicted_peak_bytes)
    assert measured <= budget * 1.05


def test_qlora_stores_the_frozen_base_compactly_and_is_predicted_within_5_percent():
    model = adapted()
    unplanned = plan_for(model, 1 << 40)
    budget = int(unplanned.full_peak_bytes * 0.5)
    plan = plan_for(model, budget)
    compact = {entry.storage for entry in plan.changed_entries()}
    assert compact and compact <= set(training_storages()) - {"keep"}
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    stored = {leaf for entry in plan.changed_entries() for leaf in entry.leaves}
    assert not any(f"{leaf}.weight" in trained for leaf in stored)  # adapters stay as they are
    measured = measured_peak(model, plan)
    assert abs(measured / plan.predicted_peak_bytes - 1) < 0.05, (measured, plan.predicted_peak_bytes)


def test_casting_storages_are_not_offered_for_training():
    """A cast weight's upcast copy waits for the backward: more than the weight it replaced."""
    assert "bfloat16" not in training_storages() and "float8" not in training_storages()
    assert "int8" not in training_storages()  # its outlier path depends on the data
    assert {"keep", "nf4"} <= set(training_storages())


def test_a_budget_nothing_meets_is_refused_with_what_dominates(full_fine_tune):
    model, _ = full_fine_tune
    with pytest.raises(tightfit.FitError, match="cannot be met on cpu for a training step") as caught:
        plan_for(model, "1MB")
    error = caught.value
    assert error.smallest_peak_bytes > error.budget_bytes == 1_000_000
    assert [size for _, size in error.parts] == sorted((size for _, size in error.parts), reverse=True)
    assert any("optimizer state" in what for what, _ in error.parts)


def test_the_plan_round_trips_through_json_and_says_what_it_chose(full_fine_tune):
    model, unplanned = full_fine_tune
    plan = plan_for(model, int(unplanned.full_peak_bytes * 0.6))
    assert TrainingPlan.from_json(plan.to_json()) == plan
    shown = str(plan)
    assert "training plan: LlamaForCausalLM" in shown and "optimizer: AdamW" in shown
    for name in plan.activations:
        assert name in shown or "..." in shown


@pytest.mark.parametrize(
    "extra, error, words",
    [
        (dict(optimizer="Adamw"), ValueError, "optimizer='Adamw' is not accepted; accepted: .*AdamW"),
        (dict(decode_steps=3), ValueError, "decode_steps is an option of an inference plan only"),
        (dict(units="blocks", max_error="3%"), ValueError, "max_error, units are options"),
        (dict(training="yes"), TypeError, "training"),
        (dict(training=False, optimizer="Lion"), ValueError, "optimizer='Lion' sizes a training step's state"),
    ],
)
def test_bad_training_arguments_are_refused(full_fine_tune, extra, error, words):
    model, _ = full_fine_tune
    arguments = dict(training=True, calibration=figures()) | extra
    with pytest.raises(error, match=words):
        tightfit.fit(model, INPUTS, 1 << 30, **arguments)


def test_a_model_with_nothing_to_train_is_refused():
    with pytest.raises(ValueError, match="no parameter of LlamaForCausalLM requires grad"):
        plan_for(llama().requires_grad_(False), 1 << 30)


def test_a_plan_applies_only_to_its_model_and_keeps_its_own_optimizer_settings(full_fine_tune):
    model, plan = full_fine_tune
    with pytest.raises(ValueError, match="has no module 'model.embed_tokens', which this plan decides for"):
        plan.apply(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="optim_bits is the plan's"):
        plan.make_optimizer(model.parameters(), optim_bits=8)
    optimizer = plan.make_optimizer(model.parameters(), lr=1e-3)
    assert type(optimizer).__name__ == "AdamW" and optimizer.param_groups[0]["optim_bits"] == plan.optim_bits


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(optimizer="adam"), "TrainingPlan.optimizer must be one of"),
        (dict(optim_bits=4), "optim_bits must be 8 or 32"),
        (dict(activations={"model.layers.0": "drop"}), "must be one of recompute, offload"),
        (dict(predicted_peak_bytes=-1), "predicted_peak_bytes must be an int >= 0"),
        (dict(full_seconds=float("nan")), "full_seconds must be a finite number"),
        (dict(optimizer=["AdamW"]), "TrainingPlan.optimizer must be one of"),
        (dict(optim_bits=8.0), "optim_bits must be 8 or 32"),
        (dict(activations={"model.layers.0": "offload"}), "'offload', but the plan is for the CPU"),
    ],
)
def test_a_plan_with_bad_fields_is_refused(full_fine_tune, change, words):
    import dataclasses

    _, plan = full_fine_tune
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(plan, **change)


def test_json_that_is_not_a_training_plan_is_refused():
    for text, words in (
        ("[]", "not a tightfit training plan"),
        ('{"format": "tightfit.plan/1"}', "not a tightfit training plan"),
    ):
        with pytest.raises(ValueError, match=words):
            TrainingPlan.from_json(text)


def test_a_step_measurement_refuses_bad_arguments():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="optimizer"):
        measure_training_step(model, (torch.ones(2),), {}, object(), "cpu")
    with pytest.raises(ValueError, match="steps"):
        measure_training_step(model, (torch.ones(2),), {}, optimizer, "cpu", steps=0)
    with pytest.raises(TypeError, match="kwargs"):
        measure_training_step(model, (torch.ones(2),), None, optimizer, "cpu")
    with pytest.raises(TypeError, match="args"):
        measure_training_step(model, torch.ones(2), {}, optimizer, "cpu")


@pytest.mark.parametrize("eight_bit_seconds, bits, recomputes", [(1e-6, 32, True), (1e-12, 8, False)])
def test_the_optimizer_s_measured_step_decides_between_8_bit_state_and_recomputing(
    full_fine_tune, eight_bit_seconds, bits, recomputes
):
    """At 80% of the unplanned step either 8-bit state or recomputing layers fits: the
    calibration's per-value step times choose (a slow 8-bit step: recompute instead)."""
    model, unplanned = full_fine_tune
    timed = figures(optimizer_seconds={"8": eight_bit_seconds, "32": 1e-12})
    plan = tightfit.fit(model, INPUTS, int(unplanned.full_peak_bytes * 0.8), training=True, calibration=timed)
    assert plan.optim_bits == bits and bool(plan.activations) == recomputes


#: A plan of a small stack, saved and damaged by the generated cases.
SMALL_PLAN = tightfit.fit(
    nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
    torch.ones(2, 8),
    1 << 30,
    training=True,
    calibration=figures(),
)
json_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6), st.lists(st.integers(), max_size=3)
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(sorted(json.loads(SMALL_PLAN.to_json()))), value=json_values)
def test_generated_damage_to_a_saved_plan_is_refused_naming_it(key, value):
    data = json.loads(SMALL_PLAN.to_json())
    data[key] = value
    try:
        loaded = TrainingPlan.from_json(json.dumps(data))
    except ValueError as error:
        assert "training plan" in str(error)
        return
    assert isinstance(loaded, TrainingPlan)  # the value was one the field takes


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(128, 512), nn.Linear(512, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("recomputed", [0, 2, 4])
def test_the_simulated_backward_matches_the_allocator_with_layers_recomputed(recomputed):
    """The residual sums of a forward recomputed in the backward make new tensors, as they
    do for real: only autograd's own sums of gradients are made in place."""
    from tightfit.hooks.activations import apply_activation_policy, remove_activation_policy
    from tightfit.memory import allocated_peak
    from tightfit.memory.simulate import simulate_eager

    torch.manual_seed(0)
    model = nn.Sequential(*[Residual() for _ in range(4)])
    x = torch.randn(256, 128, requires_grad=True)
    apply_activation_policy(model, {str(index): "recompute" for index in range(recomputed)})
    timeline = simulate_eager(model, (x,), {}, device=torch.device("cpu"), training=True)
    simulated = max(timeline.live_bytes("cpu"))

    def step() -> None:  # as the simulation runs it: the backward from the output, with a gradient of ones
        out = model(x)
        out.backward(torch.ones_like(out))
        del out
        model.zero_grad(set_to_none=True)
        x.grad = None

    step()
    measured = allocated_peak(step)
    remove_activation_policy(model)
    assert abs(measured / simulated - 1) < 0.02, (measured, simulated)


@pytest.mark.parametrize("unified, paged", [(False, True), (True, False)])
def test_paged_state_is_offered_only_where_the_device_s_memory_is_not_the_host_s(monkeypatch, unified, paged):
    """A backend that declares unified memory (Apple silicon) gains nothing from paging."""
    import types

    from tightfit.backends import registry
    from tightfit.fitting.training import _state_forms

    capabilities = types.SimpleNamespace(unified_memory=unified)
    monkeypatch.setattr(registry, "get", lambda device: types.SimpleNamespace(capabilities=lambda: capabilities))
    assert registry.shares_host_memory(torch.device("cpu"))
    assert registry.shares_host_memory(torch.device("mps")) == unified
    params = [nn.Parameter(torch.empty(64, 128, device="meta"))]
    forms = _state_forms("adam", params, torch.device("mps"), figures(host_to_device_bandwidth=1e10), 4096)
    assert any(form.paged for form in forms) == paged
    assert {form.bits for form in forms} == {8, 32}
