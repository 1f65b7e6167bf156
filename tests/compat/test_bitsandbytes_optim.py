"""``tightfit.compat.bitsandbytes.optim`` beside bitsandbytes' own optimizers: the same names
and signatures, state dicts that load both ways unchanged, the same step from the same state
(tightfit's is the specification, bit for bit; bitsandbytes' is held to it within its own
tests' tolerance through PeerCheck), and the global manager's overrides."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import tightfit.compat.bitsandbytes as tbnb
from tightfit.ops import get_op
from zoo.optim import copied, spec_step
from zoo.peer import PeerCheck

bnb = pytest.importorskip("bitsandbytes")

PAIRS = {
    "Adam8bit": {},
    "AdamW8bit": {},
    "PagedAdamW8bit": {},
    "AdEMAMix8bit": {"t_alpha": 5, "t_beta3": 5},
    "Lion8bit": {},
    "SGD8bit": {"lr": 0.01, "momentum": 0.9},
    "RMSprop8bit": {"lr": 0.01},
    "Adagrad8bit": {},
    "Adam": {},
    "Lion": {},
}


def _classes(module) -> dict[str, type]:
    return {n: c for n, c in vars(module).items() if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer)}


def test_every_optimizer_bitsandbytes_offers_is_here_with_its_signature():
    theirs, ours = _classes(bnb.optim), _classes(tbnb.optim)
    for name, cls in theirs.items():
        if name.startswith("_") or name in ("Optimizer8bit", "Optimizer1State", "Optimizer2State"):
            continue
        assert name in ours, name
        expected = inspect.signature(cls.__init__).parameters
        got = inspect.signature(ours[name].__init__).parameters
        assert list(got) == list(expected), name
        assert [p.default for p in got.values()] == [p.default for p in expected.values()], name
    assert hasattr(tbnb.optim.GlobalOptimManager, "get_instance")


def _stepped(cls, p: torch.Tensor, steps: int, seed: int, **settings):
    optimizer = cls([p], **settings)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=generator) * 0.01
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bitsandbytes warns that paging falls back on the CPU
            optimizer.step()
    return optimizer


def _quant(state_dict: dict) -> dict:
    entry = state_dict["state"][0]
    return {**{k: v for k, v in entry.items() if k != "__bnb_optimizer_quant_state__"}, **entry.get(
        "__bnb_optimizer_quant_state__", {}
    )}  # fmt: skip


def _decoded(state: dict) -> torch.Tensor:
    """The first state's values (AdEMAMix: its fast EMA), by the reference decode."""
    codes, absmax = state["state1"], state["absmax1"]
    if absmax.dim() == 2:
        codes, absmax = codes[0], absmax[0]
    return get_op("dequantize_blockwise").reference(codes, absmax, state["qmap1"], 256, torch.float32)


@pytest.mark.parametrize("name", PAIRS)
def test_state_dicts_load_both_ways_and_the_same_step_follows_the_specification(name):
    settings = PAIRS[name]
    start = torch.randn(1024, 20, generator=torch.Generator().manual_seed(0)) * 0.1
    theirs_p = start.clone()
    theirs = _stepped(getattr(bnb.optim, name), theirs_p, 4, seed=1, **settings)
    saved = copy.deepcopy(theirs.state_dict())
    ours_p = theirs_p.clone()
    ours = getattr(tbnb.optim, name)([ours_p], **settings)
    ours.load_state_dict(saved)
    for key, value in _quant(saved).items():
        mine = ours.state[ours_p][key]
        assert torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value, key
    # ours written back, read by bitsandbytes: the same tensors
    back = getattr(bnb.optim, name)([theirs_p.clone()], **settings)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    for key, value in _quant(saved).items():
        got = back.state[next(iter(back.state))][key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key
    # one more step from the same state: ours is the specification to the bit
    grad = torch.randn(1024, 20, generator=torch.Generator().manual_seed(2)) * 0.01
    expected_p, expected_state = ours_p.clone(), copied(ours.state[ours_p])
    spec_step(ours, expected_state, expected_p, grad)
    ours_p.grad = grad.clone()
    ours.step()
    assert torch.equal(ours_p, expected_p)
    # bitsandbytes' step, held to the specification within its own tests' tolerances
    peer = PeerCheck()
    theirs_p.grad = grad.clone()
    peer.runs(f"bitsandbytes.optim.{name}.step", theirs.step)
    peer.agrees(f"bitsandbytes.optim.{name}.step (parameters)", theirs_p, expected_p, atol=1e-5)
    if expected_state["state1"].dtype == torch.uint8:
        peer.agrees(
            f"bitsandbytes.optim.{name}.step (first state, decoded)",
            _decoded(theirs.state[theirs_p]),
            _decoded(expected_state),
            atol=3e-3,
        )
    peer.settle()


def test_the_global_manager_overrides_a_parameters_width_registered_before_or_after():
    manager = tbnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    first, second, third = (torch.randn(64, 64) for _ in range(3))
    manager.override_config(third, "optim_bits", 8)
    manager.register_parameters([first, second, third])
    manager.override_config(second, key_value_dict={"optim_bits": 8, "lr": 0.0})
    adam = tbnb.optim.Adam([first, second, third], lr=1e-3, min_8bit_size=0)
    before = second.clone()
    for p in (first, second, third):
        p.grad = torch.randn_like(p)
    adam.step()
    assert [adam.state[p]["state1"].dtype for p in (first, second, third)] == [torch.float32, torch.uint8, torch.uint8]
    assert torch.equal(second, before)  # lr 0 for it alone
    manager.initialize()


def test_a_module_override_applies_to_that_modules_weight():
    manager = tbnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    embedding, linear = torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256)
    manager.register_module_override(embedding, "weight", {"optim_bits": 32})
    adam = tbnb.optim.Adam8bit([*embedding.parameters(), *linear.parameters()])
    for p in (*embedding.parameters(), *linear.parameters()):
        p.grad = torch.ones_like(p)
    adam.step()
    assert adam.state[embedding.weight]["state1"].dtype == torch.float32
    assert adam.state[linear.weight]["state1"].dtype == torch.uint8
    manager.initialize()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: tbnb.optim.Adam8bit(p, amsgrad=True), "amsgrad"),
        (lambda p: tbnb.optim.SGD(p, 0.01, 0.9, nesterov=True), "nesterov"),
        (lambda p: tbnb.optim.SGD(p, 0.01, 0.9, dampening=0.1), "dampening"),
        (lambda p: tbnb.optim.RMSprop(p, momentum=0.9), "momentum"),
        (lambda p: tbnb.optim.RMSprop(p, centered=True), "Centered"),
        (lambda p: tbnb.optim.Adagrad(p, lr_decay=0.1), "Lr Decay"),
        (lambda p: tbnb.optim.SGD(p, 0.01), "without momentum"),
        (lambda p: tbnb.optim.LARS(p, 0.01), "without momentum"),
        (lambda p: tbnb.optim.RMSprop(p, alpha=0), "alpha==0.0"),
    ],
)
def test_arguments_bitsandbytes_would_ignore_or_refuses_are_refused(make, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        make([torch.zeros(8, requires_grad=True)])


def test_paged_classes_run_on_the_cpu_without_a_fallback_warning():
    p = torch.randn(8192)
    optimizer = tbnb.optim.PagedAdamW8bit([p])
    p.grad = torch.randn_like(p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
    assert optimizer.paged and optimizer.state[p]["state1"].device.type == "cpu"


def test_the_plain_torch_ademamix_bitsandbytes_tests_against_is_followed_by_ours():
    p = torch.randn(4096 + 10) * 0.1
    q = p.clone()
    reference = tbnb.optim.ademamix._ReferenceAdEMAMix([p], t_alpha=5, t_beta3=5)
    ours = tbnb.optim.AdEMAMix32bit([q], t_alpha=5, t_beta3=5)
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        grad = torch.randn(p.shape, generator=generator) * 0.01
        p.grad, q.grad = grad, grad.clone()
        reference.step()
        ours.step()
    torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.state[q]["state1"], reference.state[p]["m1_m2"], rtol=1e-5, atol=1e-7)
    assert tbnb.utils.sync_gpu(q) is None


def test_lars_follows_bitsandbytes_and_its_torch_reference():
    start = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    ours_p, theirs_p, reference_p = start.clone(), start.clone(), start.clone()
    ours = tbnb.optim.LARS([ours_p], 0.01, 0.9, weight_decay=0.01)
    reference = tbnb.optim.PytorchLARS([reference_p], 0.01, 0.9, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        grad = torch.randn(start.shape, generator=generator) * 0.5
        ours_p.grad, reference_p.grad = grad, grad.clone()
        ours.step()
        reference.step()
    torch.testing.assert_close(ours_p, reference_p, rtol=1e-5, atol=1e-6)
    theirs = bnb.optim.LARS([theirs_p], 0.01, 0.9, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        theirs_p.grad = torch.randn(start.shape, generator=generator) * 0.5
        theirs.step()
    peer = PeerCheck()
    peer.agrees("bitsandbytes.optim.LARS.step", theirs_p, ours_p, atol=1e-6)
    peer.settle()


def test_lamb_bounds_each_update_to_max_unorm_times_the_parameters_norm():
    p = torch.nn.Parameter(torch.randn(128, 128, generator=torch.Generator().manual_seed(0)))
    before = p.detach().clone()
    optimizer = tbnb.optim.LAMB([p], lr=1.0, max_unorm=1e-3)
    p.grad = torch.randn(128, 128, generator=torch.Generator().manual_seed(1)) * 5.0
    optimizer.step()
    # lr 1 and no decay: the step is the bounded update itself (Adam's first step has norm sqrt(numel))
    assert float((p.detach() - before).norm()) == pytest.approx(1e-3 * float(before.norm()), rel=1e-4)
    assert optimizer.args.max_unorm == 1e-3
    with pytest.raises(ValueError, match="max_unorm=1.0"):
        tbnb.optim.LAMB8bit([p], max_unorm=0.5)
