"""Activation policies on modules: recompute gives the gradients keeping gives, bit for bit,
and holds less between the forward and the backward; offload is refused where the module's
memory is the host's; removing the hooks leaves the module as it was; bad input is named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tightfit.hooks.activations import (
    ActivationHook,
    activation_policies,
    apply_activation_policy,
    remove_activation_policy,
)
from tightfit.memory import LiveTensorBytes


def stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)])


def step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """Gradients of a forward and backward, and the most bytes alive between the two."""
    with LiveTensorBytes("cpu") as tracker:
        out = model(x)
        held = tracker.current
    out.sum().backward()
    return [p.grad.clone() for p in model.parameters()], held


def test_recompute_gives_the_same_gradients_and_holds_less():
    x = torch.randn(32, 64)
    kept_grads, kept_bytes = step(stack(), x)
    model = stack()
    apply_activation_policy(model, {"0": "recompute", "1": "recompute"})
    assert activation_policies(model) == {"0": "recompute", "1": "recompute"}
    grads, held = step(model, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads))
    assert held < kept_bytes


def test_keep_and_removal_leave_the_module_as_it_was():
    model = stack()
    apply_activation_policy(model, {"0": "recompute", "2": "recompute"})
    apply_activation_policy(model, {"0": "keep"})
    assert activation_policies(model) == {"2": "recompute"}
    assert remove_activation_policy(model) == ["2"]
    assert activation_policies(model) == {} and "forward" not in model[2].__dict__


def test_without_grad_the_forward_runs_as_it_is():
    model = stack()
    apply_activation_policy(model, {"": "recompute"})
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(model(x), nn.Sequential(*model).forward(x))


def test_offload_is_refused_on_the_cpu_and_taken_on_meta():
    with pytest.raises(ValueError, match=r"policies\['0'\]='offload' .* on the CPU"):
        apply_activation_policy(stack(), {"0": "offload"})
    planned = stack().to("meta")
    apply_activation_policy(planned, {"0": "offload"})
    assert activation_policies(planned) == {"0": "offload"}


@pytest.mark.parametrize(
    "policies, error, words",
    [
        ({"9": "recompute"}, ValueError, "policies names '9', which is not a module of Sequential"),
        ({"0": "drop"}, ValueError, r"policies\['0'\]='drop' is not accepted; accepted: keep, offload, recompute"),
        ({0: "recompute"}, TypeError, "policies key"),
        ([("0", "recompute")], TypeError, "policies"),
    ],
)
def test_bad_policies_are_refused_before_anything_changes(policies, error, words):
    model = stack()
    with pytest.raises(error, match=words):
        apply_activation_policy(model, {"1": "recompute", **policies} if isinstance(policies, dict) else policies)
    assert activation_policies(model) == {}


def test_the_hook_says_its_policy():
    assert repr(ActivationHook("recompute")) == "ActivationHook('recompute')"


names = st.one_of(st.sampled_from(["", "0", "1", "2", "0.0", "9", "x"]), st.text(max_size=4), st.integers(), st.none())
policies_values = st.one_of(st.sampled_from(["keep", "recompute", "offload", "drop", ""]), st.integers(), st.none())


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.dictionaries(names, policies_values, max_size=4), st.lists(st.text(max_size=3)), st.none()))
def test_generated_policies_apply_whole_or_are_refused_naming_them(policies):
    model = stack()
    before = activation_policies(model)
    try:
        apply_activation_policy(model, policies)
    except (ValueError, TypeError) as error:
        assert "policies" in str(error) or "offload" in str(error)
        assert activation_policies(model) == before  # nothing changed
        return
    expected = {name: policy for name, policy in policies.items() if policy != "keep"}
    assert activation_policies(model) == expected
