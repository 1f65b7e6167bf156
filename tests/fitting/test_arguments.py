"""fit() and Allow refuse bad arguments with errors that name the argument, value and what is accepted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit
from tightfit.fitting import Allow
from zoo.lm import figures

MODEL = nn.Sequential(nn.Linear(4, 4))
X = (torch.randn(2, 4),)


@pytest.mark.parametrize(
    "budget, error, message",
    [
        (0, ValueError, "budget=0 is not accepted"),
        (-5, ValueError, "budget=-5 is not accepted"),
        ("lots", ValueError, "budget='lots' is not a size"),
        (True, TypeError, "budget must be an int or a str"),
        (1.5e9, TypeError, "budget must be an int or a str"),
        (float("nan"), TypeError, "budget must be an int or a str"),
        ({"cpu": "1GB"}, TypeError, r"gives a budget per device; fit plans one device.*plan_stages"),
    ],
)
def test_bad_budgets(budget, error, message):
    with pytest.raises(error, match=message):
        tightfit.fit(MODEL, X, budget, calibration=figures())


def test_bad_model_inputs_and_options():
    with pytest.raises(TypeError, match="model must be Module"):
        tightfit.fit("model", X, "1MB", calibration=figures())
    with pytest.raises(TypeError, match="example_inputs must be a tuple or list of tensors, a dict"):
        tightfit.fit(MODEL, 3, "1MB", calibration=figures())
    with pytest.raises(TypeError, match="example_inputs key must be str"):
        tightfit.fit(MODEL, {1: X[0]}, "1MB", calibration=figures())
    with pytest.raises(TypeError, match="calibration must be Calibration"):
        tightfit.fit(MODEL, X, "1MB", calibration={"matmul_flops": 1})
    with pytest.raises(TypeError, match="remeasure must be bool"):
        tightfit.fit(MODEL, X, "1MB", calibration=figures(), remeasure=1)
    with pytest.raises(ValueError, match="not-a-backend"):
        tightfit.fit(MODEL, X, "1MB", backend="not-a-backend", calibration=figures())


def test_a_single_tensor_is_one_positional_input():
    plan = tightfit.fit(MODEL, X[0], "1MB", calibration=figures())
    assert plan.applies_nothing


@pytest.mark.parametrize(
    "allow, error, message",
    [
        ({"storage": {"keep", "gguf"}}, ValueError, "'gguf', which is not accepted; accepted: keep, bfloat16, float8"),
        ({"placement": {"device", "cloud"}}, ValueError, "'cloud', which is not accepted; accepted: device, cpu, disk"),
        ({"storage": "keep"}, TypeError, "allow storage must be a set of str"),
        ({"storage": {"nf4"}}, ValueError, "lacks 'keep', which is always allowed"),
        ({"placement": {"disk"}}, ValueError, "lacks 'device', which is always allowed"),
        ({"storage": set()}, ValueError, "allow storage is empty"),
        ({"quant": {"nf4"}}, ValueError, "allow has key\\(s\\) 'quant'"),
        ({"hints": "no"}, TypeError, "allow hints must be a bool, got str: 'no'; accepted: True, False"),
        ({"hints": 0}, TypeError, "allow hints must be a bool, got int: 0"),
        (["keep"], TypeError, "allow must be None, a str such as .keep,float8,disk., an Allow or a dict"),
    ],
)
def test_bad_allow(allow, error, message):
    with pytest.raises(error, match=message):
        tightfit.fit(MODEL, X, "1MB", allow=allow, calibration=figures())


def test_allow_defaults_and_coercion():
    assert Allow() == Allow.coerce(None) == Allow.coerce({})
    assert Allow.coerce({"storage": ["keep", "float8"]}).storage == frozenset({"keep", "float8"})
    assert Allow().to_dict() == {
        "storage": ["8bit", "bfloat16", "float8", "fp4", "int8", "keep", "nf4"],
        "placement": ["cpu", "device", "disk"],
        "hints": True,
    }
    assert Allow.coerce({"hints": False}).hints is False
    allow = Allow(storage={"keep"}, placement=("device", "disk"))
    assert isinstance(allow.storage, frozenset) and hash(allow)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ([X[0], 3], r"example_inputs\[1\] must be Tensor, got int: 3"),
        ((X[0], None), r"example_inputs\[1\] must be Tensor, got NoneType"),
        ({"input": [1.0]}, r"example_inputs\['input'\] must be Tensor, got list"),
    ],
)
def test_every_example_input_must_be_a_tensor(inputs, message):
    with pytest.raises(TypeError, match=message):
        tightfit.fit(MODEL, inputs, "1MB", calibration=figures())


def test_a_list_of_tensors_is_positional_inputs():
    assert tightfit.fit(MODEL, [X[0]], "1MB", calibration=figures()).applies_nothing


def test_calibration_must_be_of_the_plans_backend():
    with pytest.raises(ValueError, match="calibration is of backend 'cuda' but the plan is for backend 'cpu'"):
        tightfit.fit(MODEL, X, "1MB", calibration=figures(backend="cuda", host_to_device_bandwidth=1e10))


def test_a_plan_for_an_accelerator_needs_the_host_to_device_figure():
    from tightfit.fitting import planner

    with pytest.raises(
        ValueError, match="calibration has host_to_device_bandwidth=None, which a plan for cuda:0 needs"
    ):
        planner._check_calibration(figures(backend="cuda"), "cuda", torch.device("cuda:0"))
    planner._check_calibration(figures(backend="cuda", host_to_device_bandwidth=1e10), "cuda", torch.device("cuda:0"))


@pytest.mark.parametrize(
    "model, device, error, message",
    [
        (MODEL, "bogus", ValueError, "device='bogus' is not a valid torch device"),
        (MODEL, 5, TypeError, "device must be torch.device or str, got int: 5"),
        (MODEL, None, TypeError, "device must be torch.device or str, got NoneType"),
        ("model", "cpu", TypeError, "model must be Module, got str"),
    ],
)
def test_held_bytes_refuses_bad_arguments(model, device, error, message):
    from tightfit.fitting import held_bytes

    with pytest.raises(error, match=message):
        held_bytes(model, device)


def test_held_bytes_accepts_strings_and_devices():
    from tightfit.fitting import held_bytes

    assert held_bytes(MODEL, "cpu") == held_bytes(MODEL, torch.device("cpu")) == 4 * (16 + 4)
    assert held_bytes(MODEL, "meta") == 0
