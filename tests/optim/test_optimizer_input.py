"""Bad input to the optimizers and their ops is refused with an error naming it (D7, D9):
hostile state dicts (generated corruptions), bad settings, bad raw-op arguments. A refused
state dict leaves the optimizer as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tightfit.optim as optim
from tightfit.ops import optimizer_update_8bit_blockwise, optimizer_update_32bit


def stepped(rule=optim.AdEMAMix, bits=8) -> tuple[torch.Tensor, optim.BlockwiseOptimizer]:
    p = torch.randn(4096 + 100) * 0.1
    optimizer = rule([p], optim_bits=bits)
    p.grad = torch.randn_like(p) * 0.01
    optimizer.step()
    return p, optimizer


def corrupt(state: dict, key: str, how: str) -> None:
    value = state[key]
    if how == "missing":
        del state[key]
    elif how == "dtype":
        state[key] = value.to(torch.float64 if value.dtype != torch.float64 else torch.float32)
    elif how == "shape":
        state[key] = value.reshape(-1)[:-1] if value.numel() > 1 else value.reshape(1, 1)
    elif how == "nan":
        state[key] = value.clone()
        state[key].view(-1)[0] = math.nan
    elif how == "negative":
        state[key] = -value.abs() - 1
    elif how == "shuffled":
        state[key] = value.flip(0)
    elif how == "not a tensor":
        state[key] = [1.0, 2.0]


_FLOAT_KEYS = ("absmax1", "absmax2", "qmap1", "qmap2")
_CASES = st.one_of(
    st.tuples(st.sampled_from(("state1", "state2") + _FLOAT_KEYS), st.sampled_from(("missing", "dtype", "shape"))),
    st.tuples(st.sampled_from(_FLOAT_KEYS), st.just("nan")),
    st.tuples(st.sampled_from(("absmax1", "absmax2")), st.just("negative")),
    st.tuples(st.sampled_from(("qmap1", "qmap2")), st.just("shuffled")),
    st.tuples(st.sampled_from(("state1", "absmax2", "qmap1")), st.just("not a tensor")),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_CASES)
def test_hostile_state_is_refused_and_the_optimizer_is_left_as_it_was(case):
    key, how = case
    p, optimizer = stepped()
    before = copy.deepcopy(optimizer.state_dict())
    hostile = copy.deepcopy(before)
    entry = hostile["state"][0]
    quant = entry["__bnb_optimizer_quant_state__"]
    corrupt(quant, key, how)
    with pytest.raises((ValueError, TypeError), match=key if how != "missing" else f"'{key}'"):
        optimizer.load_state_dict(hostile)
    after = optimizer.state_dict()
    for name, value in before["state"][0]["__bnb_optimizer_quant_state__"].items():
        assert torch.equal(after["state"][0]["__bnb_optimizer_quant_state__"][name], value)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda sd: sd["state"][0].update(step=-1), "step"),
        (lambda sd: sd["state"][0].update(step="3"), "step"),
        (lambda sd: sd["state"].update({7: sd["state"][0]}), "no param group lists"),
        (lambda sd: sd["param_groups"][0].update(lr=-1.0), "lr"),
        (lambda sd: sd["param_groups"][0].update(betas=(1.5, 0.9, 0.9)), "betas"),
        (lambda sd: sd["param_groups"][0].update(optim_bits=4), "optim_bits"),
        (lambda sd: sd["param_groups"][0].update(params=[0, 1]), "parameter ids"),
        (lambda sd: sd["param_groups"].append({}), "groups"),
        (lambda sd: sd.pop("state"), "'state'"),
    ],
)
def test_a_bad_state_dict_is_refused_naming_what_is_wrong(change, match):
    _, optimizer = stepped()
    hostile = copy.deepcopy(optimizer.state_dict())
    change(hostile)
    with pytest.raises((ValueError, TypeError), match=match):
        optimizer.load_state_dict(hostile)


def test_32bit_state_with_nan_is_refused():
    _, optimizer = stepped(optim.Adam, bits=32)
    hostile = copy.deepcopy(optimizer.state_dict())
    hostile["state"][0]["__bnb_optimizer_quant_state__"]["state2"][3] = math.inf
    with pytest.raises(ValueError, match="state2.*NaN or inf"):
        optimizer.load_state_dict(hostile)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: optim.Adam(p, lr=-1e-3), "lr"),
        (lambda p: optim.Adam(p, lr=math.nan), "lr"),
        (lambda p: optim.Adam(p, betas=(0.9, 1.0)), r"betas\[1\]"),
        (lambda p: optim.Adam(p, betas=(0.9,)), "betas"),
        (lambda p: optim.Adam(p, eps=-1.0), "eps"),
        (lambda p: optim.Adam(p, weight_decay="0.1"), "weight_decay"),
        (lambda p: optim.Adam(p, optim_bits=16), "optim_bits"),
        (lambda p: optim.Adam(p, min_8bit_size=-1), "min_8bit_size"),
        (lambda p: optim.Adam(p, paged="yes"), "paged"),
        (lambda p: optim.AdEMAMix(p, t_alpha=0), "t_alpha"),
        (lambda p: optim.SGD(p, 0.01, 0.0), "momentum"),
        (lambda p: optim.RMSprop(p, alpha=0), "alpha"),
    ],
)
def test_bad_settings_are_refused_naming_them(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make([torch.zeros(8, requires_grad=True)])


def test_a_sparse_gradient_is_refused():
    p = torch.zeros(8)
    optimizer = optim.Adam([p])
    p.grad = torch.zeros(8).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        optimizer.step()


def _raw_32bit(**change):
    p = torch.zeros(300)
    args = dict(optimizer_name="adam", g=torch.zeros(300), p=p, state1=torch.zeros(300), state2=torch.zeros(300))
    args.update(change)
    return lambda: optimizer_update_32bit(**args, beta1=0.9, beta2=0.999, eps=1e-8, step=1, lr=1e-3)


def _raw_8bit(**change):
    args = dict(
        optimizer_name="lion",
        g=torch.zeros(300),
        p=torch.zeros(300),
        state1=torch.zeros(300, dtype=torch.uint8),
        absmax1=torch.zeros(2),
        qmap1=torch.linspace(-1, 1, 256),
    )
    args.update(change)
    return lambda: optimizer_update_8bit_blockwise(**args, beta1=0.9, beta2=0.99, step=1, lr=1e-4)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (_raw_32bit(optimizer_name="adamw"), "optimizer_name"),
        (_raw_32bit(state2=None), "needs state2"),
        (_raw_32bit(state1=torch.zeros(299)), "state1"),
        (_raw_32bit(state1=torch.zeros(300, dtype=torch.float16)), "state1"),
        (_raw_32bit(g=torch.zeros(300, dtype=torch.bfloat16)), "g must match p"),
        (_raw_32bit(p=torch.zeros(600)[::2]), "contiguous"),
        (_raw_32bit(p=torch.zeros(300, dtype=torch.int32), g=torch.zeros(300, dtype=torch.int32)), "p.dtype"),
        (_raw_32bit(g=[0.0] * 300), "g must be Tensor"),
        (_raw_8bit(absmax1=torch.zeros(3)), "absmax1"),
        (_raw_8bit(qmap1=torch.zeros(255)), "qmap1"),
        (_raw_8bit(qmap1=torch.linspace(1, -1, 256)), "sorted"),
        (_raw_8bit(state2=torch.zeros(300, dtype=torch.uint8)), "one state"),
        (_raw_8bit(state1=torch.zeros(300)), "state1"),
    ],
)
def test_raw_ops_refuse_bad_arguments_naming_them(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize(
    ("name", "value"), [("beta1", 1.0), ("beta1", math.nan), ("lr", -1.0), ("eps", math.inf), ("step", 0)]
)
def test_raw_ops_refuse_bad_hyperparameters(name, value):
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, step=1, lr=1e-3) | {name: value}
    p = torch.zeros(8)
    with pytest.raises(ValueError, match=name):
        optimizer_update_32bit("adam", torch.zeros(8), p, torch.zeros(8), torch.zeros(8), **hyper)


def test_a_gradient_that_does_not_fit_changes_nothing():
    p = torch.randn(4096 + 100) * 0.1
    optimizer = optim.LAMB([p], weight_decay=0.1)  # its bounded path changes p before the op runs
    p.grad = torch.randn_like(p)
    optimizer.step()
    before, state = p.clone(), copy.deepcopy(optimizer.state[p])
    p.grad_dtype = None  # torch refuses a gradient of another dtype unless told to allow one
    p.grad = torch.randn(p.shape, dtype=torch.float64)
    with pytest.raises(ValueError, match="gradient must match"):
        optimizer.step()
    assert torch.equal(p, before) and optimizer.state[p]["step"] == state["step"] == 1
    assert torch.equal(optimizer.state[p]["state1"], state["state1"])
