"""DFS hints in plans: chosen only where storages and placements cannot meet the budget,
applied and removable, and true under ``FitPlan.compile``: the compiled output equals the
eager one and the allocator's peak is within the budget and near the prediction."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.fitting import FitError, FitPlan, remove_hints
from tightfit.memory import allocated_peak
from zoo.lm import figures, tiny_lm, token_ids

KEEP = {"storage": {"keep"}, "placement": {"device"}}


@pytest.fixture(scope="module")
def case():
    """A tiny LM whose activations (batch 16 x 128 tokens) are ten times its weights."""
    model = tiny_lm(width=64, hidden=256, depth=2, vocab=500)
    ids = token_ids(batch=16, length=128, vocab=500)
    full = tightfit.fit(model, (ids,), "1GiB", calibration=figures())
    return model, ids, full


def budget(full: FitPlan, share: float) -> int:
    return int(full.predicted_weights_bytes + share * full.predicted_activation_bytes)


def test_hints_only_where_weights_cannot_meet_the_budget(case):
    model, ids, full = case
    assert full.hints == {} and full.runtime == "eager"
    assert full.predicted_activation_bytes > 5 * full.predicted_weights_bytes
    roomy = tightfit.fit(model, (ids,), budget(full, 0.98), calibration=figures())  # offloading the embedding meets it
    assert not roomy.hints and roomy.runtime == "eager" and roomy.changed_entries()
    plan = tightfit.fit(model, (ids,), budget(full, 0.4), calibration=figures(), allow=KEEP)
    assert plan.runtime == "compiled"
    assert plan.hints == {f"layers.{i}": {"schedule": "dfs", "slice_dim": 0, "slices": 8} for i in range(2)}
    assert not plan.changed_entries()
    assert plan.predicted_peak_bytes <= plan.budget_bytes < full.predicted_peak_bytes
    assert "hints on 2 module(s) (layers.0, layers.1)" in str(plan) and "not in eager calls" in str(plan)
    assert "runs in 8 slices over dimension 0 when compiled" in str(plan)
    assert FitPlan.from_json(plan.to_json()) == plan
    fewer = tightfit.fit(model, (ids,), budget(full, 0.6), calibration=figures(), allow=KEEP)
    assert next(iter(fewer.hints.values()))["slices"] < 8  # the fewest slices that fit


def test_allow_forbids_hints_and_the_error_says_why(case):
    model, ids, full = case
    with pytest.raises(FitError, match="Activations dominate.*allow hints=True lets fit add them"):
        tightfit.fit(model, (ids,), budget(full, 0.4), calibration=figures(), allow=KEEP | {"hints": False})
    with pytest.raises(FitError, match="fit tried 2, 4, 8, 16, 32 slices of the layer stack.*none reached the budget"):
        tightfit.fit(model, (ids,), budget(full, 0.05), calibration=figures(), allow=KEEP)


def test_applied_compiled_and_measured(case):
    model, ids, full = case
    plan = tightfit.fit(model, (ids,), budget(full, 0.4), calibration=figures(), allow=KEEP)
    forward = model.forward
    with torch.inference_mode():
        reference = model(ids)
        plan.apply(model)
        try:
            assert all(type(model.layers[i]).forward is not model.layers[i].forward for i in range(2))
            compiled = plan.compile(model)
            assert torch.allclose(compiled(ids), reference, atol=1e-5)
            measured = plan.predicted_weights_bytes + allocated_peak(lambda: compiled(ids))
        finally:
            assert remove_hints(model) == ["layers.0", "layers.1"]
    assert "forward" not in model.layers[0].__dict__ and model.forward == forward
    assert measured <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.1 * measured


def test_add_hints_refuses_bad_arguments(case):
    model = case[0]
    with pytest.raises(ValueError, match="hints names module 'nope', which model \\(TinyLM\\) does not have"):
        tightfit.fitting.add_hints(model, {"nope": {"slices": 2}})
    with pytest.raises(ValueError, match="hint slices=0 is not accepted"):
        tightfit.fitting.add_hints(model, {"layers.0": {"slices": 0}})
    tightfit.fitting.add_hints(model, {"layers.0": {"slices": 2}})
    try:
        with pytest.raises(
            ValueError, match="model's 'layers.0' has region hints already; remove_hints\\(model\\) first"
        ):
            tightfit.fitting.add_hints(model, {"layers.0": {"slices": 2}})
    finally:
        remove_hints(model)


class MixesTheBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).softmax(0)  # normalizes over the batch: slicing it would change the result


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(MixesTheBatch() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_layer_the_slicing_proof_refuses_gets_no_hints():
    model = Stack().eval()
    x = torch.randn(16, 128, 64)
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures())
    with pytest.raises(FitError, match="fit did not add them: .*normalizes along the sliced dimension"):
        tightfit.fit(model, (x,), budget(full, 0.5), calibration=figures(), allow=KEEP)
    assert "forward" not in model.layers[0].__dict__  # the hints tried are gone
