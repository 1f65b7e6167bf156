"""tightfit.optim: every rule's step is its specification (the reference kernels), bit for
bit; 32-bit rules agree with torch's optimizers; settings, paging and state dicts."""

from __future__ import annotations

import copy

import pytest
import torch

import tightfit.optim as optim
from tightfit.ops.codes import dynamic_map
from zoo.optim import copied, spec_step

RULES = {
    "adam": lambda params, **kw: optim.Adam(params, weight_decay=0.01, **kw),
    "ademamix": lambda params, **kw: optim.AdEMAMix(params, t_alpha=5, t_beta3=5, **kw),
    "momentum": lambda params, **kw: optim.SGD(params, 0.01, 0.9, weight_decay=0.01, **kw),
    "rmsprop": lambda params, **kw: optim.RMSprop(params, 0.01, 0.9, weight_decay=0.01, **kw),
    "adagrad": lambda params, **kw: optim.Adagrad(params, 0.01, weight_decay=0.01, **kw),
    "lion": lambda params, **kw: optim.Lion(params, weight_decay=0.1, **kw),
}


def parameter(numel: int = 4096 + 300, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * 0.1).to(dtype)


def gradients(p: torch.Tensor, steps: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(p.shape, generator=generator) * 0.01).to(p.dtype) for _ in range(steps)]


def reference_steps(p: torch.Tensor, grads: list[torch.Tensor], optimizer) -> tuple[torch.Tensor, dict]:
    """The specification run step by step on copies, from the state the optimizer starts from."""
    p = p.clone()
    state = copied(optimizer._new_state(p, optimizer.param_groups[0]))
    for grad in grads:
        spec_step(optimizer, state, p, grad)
    return p, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("rule", RULES)
def test_every_step_is_the_specification_bit_for_bit(rule, bits, dtype):
    p = parameter(dtype=dtype)
    grads = gradients(p, 3)
    optimizer = RULES[rule]([p], optim_bits=bits)
    expected, expected_state = reference_steps(p, grads, optimizer)
    for grad in grads:
        p.grad = grad
        optimizer.step()
    assert torch.equal(p, expected)
    state = optimizer.state[p]
    assert state["step"] == 3 and state["state1"].dtype == (torch.uint8 if bits == 8 else torch.float32)
    for key, value in expected_state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(state[key], value), key


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda p: optim.AdamW(p, optim_bits=32), lambda p: torch.optim.AdamW(p)),
        (lambda p: optim.SGD(p, 0.01, 0.9, optim_bits=32), lambda p: torch.optim.SGD(p, 0.01, 0.9)),
        (lambda p: optim.RMSprop(p, 0.01, 0.9, optim_bits=32), lambda p: torch.optim.RMSprop(p, 0.01, 0.9)),
        (lambda p: optim.Adagrad(p, optim_bits=32), lambda p: torch.optim.Adagrad(p)),
    ],
    ids=["adamw", "sgd", "rmsprop", "adagrad"],
)
def test_32bit_rules_follow_torchs_optimizers(ours, theirs):
    p, q = parameter(), parameter()
    mine, torch_optimizer = ours([p]), theirs([q])
    for grad in gradients(p, 20):
        p.grad, q.grad = grad, grad.clone()
        mine.step()
        torch_optimizer.step()
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["adam", "momentum", "rmsprop", "lion"])
def test_8bit_state_tracks_32bit_state(rule):
    p, q = parameter(), parameter()
    eight, full = RULES[rule]([p]), RULES[rule]([q], optim_bits=32)
    for grad in gradients(p, 30):
        p.grad, q.grad = grad, grad.clone()
        eight.step()
        full.step()
    moved = (q - parameter()).abs().mean()
    assert float((p - q).abs().mean() / moved) < 0.05  # within 5% of how far 32-bit state moved it


def test_small_parameters_keep_32bit_state_and_groups_choose_their_width():
    small, large, embedding = parameter(4095), parameter(8192), parameter(8192)
    optimizer = optim.Adam([{"params": [small, large]}, {"params": [embedding], "optim_bits": 32}])
    for p in (small, large, embedding):
        p.grad = torch.ones_like(p) * 1e-3
    optimizer.step()
    widths = [optimizer.state[p]["state1"].dtype for p in (small, large, embedding)]
    assert widths == [torch.float32, torch.uint8, torch.float32]
    assert optimizer.state_bytes() == (4095 * 8) + (8192 * 2 + 2 * 32 * 4 + 2 * 256 * 4) + 8192 * 8


def test_8bit_adam_state_is_a_quarter_of_32bit():
    p, q = parameter(2**16), parameter(2**16)
    eight, full = optim.Adam([p]), optim.Adam([q], optim_bits=32)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    eight.step()
    full.step()
    assert eight.state_bytes() / full.state_bytes() < 0.26


def test_paged_state_gives_the_same_parameters_as_resident_state():
    p, q = parameter(), parameter()
    paged, resident = optim.AdamW([p], paged=True), optim.AdamW([q])
    for grad in gradients(p, 5):
        p.grad, q.grad = grad, grad.clone()
        paged.step()
        resident.step()
    assert torch.equal(p, q)
    assert paged.state_bytes("cpu") == resident.state_bytes("cpu")  # host-resident: the state is where it runs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_state_on_cuda_stays_in_host_memory_and_gives_the_resident_result():
    p, q = parameter().cuda(), parameter().cuda()
    paged, resident = optim.AdamW([p], paged=True), optim.AdamW([q])
    for grad in gradients(p.cpu(), 5):
        p.grad, q.grad = grad.cuda(), grad.cuda()
        paged.step()
        resident.step()
    torch.cuda.synchronize()
    assert torch.equal(p, q)
    assert paged.state_bytes("cuda") == 2 * 256 * 4  # the two shared maps; codes and scales stay in host memory
    assert paged.state[p]["state1"].device.type == "cpu" and paged.state[p]["state1"].is_pinned()


def test_a_state_dict_resumes_exactly_where_the_optimizer_left_off():
    p = parameter()
    grads = gradients(p, 6)
    uninterrupted, q = optim.AdEMAMix([p]), p.clone()
    for grad in grads:
        p.grad = grad
        uninterrupted.step()
    first = optim.AdEMAMix([q])
    for grad in grads[:3]:
        q.grad = grad
        first.step()
    saved = copy.deepcopy(first.state_dict())
    resumed = optim.AdEMAMix([q])
    resumed.load_state_dict(saved)
    for grad in grads[3:]:
        q.grad = grad
        resumed.step()
    assert torch.equal(p, q)
    assert resumed.state[q]["qmap1"].dtype == torch.float32  # not cast to the parameter's dtype


def test_a_closure_loss_is_returned_and_parameters_without_gradients_are_left_alone():
    p, untouched = parameter(), parameter()
    optimizer = optim.Lion([p, untouched])
    p.grad = torch.ones_like(p)
    assert optimizer.step(lambda: 3.5) == 3.5
    assert not optimizer.state[untouched] and torch.equal(untouched, parameter())


def test_the_unsigned_map_is_bitsandbytes_second_moment_map():
    unsigned = dynamic_map(signed=False)
    assert unsigned.shape == (256,) and float(unsigned.min()) == 0.0 and float(unsigned.max()) == 1.0
    assert bool((unsigned[1:] >= unsigned[:-1]).all())


def test_two_optimizers_loaded_from_one_state_dict_share_no_tensor():
    p = parameter()
    first = optim.AdEMAMix([p], optim_bits=32, t_alpha=5, t_beta3=5)
    for grad in gradients(p, 2):
        p.grad = grad
        first.step()
    saved = first.state_dict()
    q, r = p.clone(), p.clone()
    a, b = (
        optim.AdEMAMix([q], optim_bits=32, t_alpha=5, t_beta3=5),
        optim.AdEMAMix([r], optim_bits=32, t_alpha=5, t_beta3=5),
    )
    a.load_state_dict(saved)
    b.load_state_dict(saved)
    grad = gradients(p, 1, seed=9)[0]
    q.grad, r.grad = grad, grad.clone()
    a.step()
    b.step()
    assert torch.equal(q, r)
    assert a.state[q]["state1"].data_ptr() != first.state[p]["state1"].data_ptr()
