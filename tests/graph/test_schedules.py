"""DFS over slices: same results as eager, forward and backward, less memory in the region."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import tightfit
from tightfit.graph.execution import observe_splits
from tightfit.graph.schedules import slice_bounds
from tightfit.memory import LiveTensorBytes
from zoo.graph import Attention, devices, fx_compile, run_recording


def _train_step(model, x):
    out = model(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    return out.detach(), grads


def _assert_close(got, expected):
    out, grads = got
    ref_out, ref_grads = expected
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("slice_dim", [1, "auto"])
def test_attention_dfs_8_slices_matches_eager_output_and_gradients(device, slice_dim, caplog):
    caplog.set_level(logging.WARNING, logger="tightfit")
    torch.manual_seed(0)
    model = Attention(hints={"schedule": "dfs", "slices": 8, "slice_dim": slice_dim}).to(device)
    x = torch.randn(2, 16, 32, device=device, requires_grad=True)
    expected = _train_step(model, x)
    got, ran = run_recording(lambda: _train_step(fx_compile(model), x))
    _assert_close(got, expected)
    sliced = [split for split in ran if split.plan is not None]
    splits = [(split.index, split.backend.name, str(split.device), split.plan is not None) for split in ran]
    assert len(sliced) == 2, f"{splits}\n{caplog.text}"  # the forward's and backward's region; else why not
    expected_dim = 1 if slice_dim == 1 else 0  # auto takes the first dimension that works: batch (2 -> 2 slices)
    assert {split.plan.dim for split in sliced} == {expected_dim}
    assert {split.plan.slices for split in sliced} == ({8} if slice_dim == 1 else {2})


def test_splits_run_on_another_thread_are_observed():
    """On a GPU autograd runs the backward on a device thread of its own: its splits ran
    unseen by a per-thread observer, and the test above found one region of two sliced."""
    model = fx_compile(Attention(hints={"schedule": "dfs", "slices": 4}))
    x = torch.randn(2, 16, 32, requires_grad=True)
    out = model(x)

    def backward_on_a_thread() -> None:
        thread = threading.Thread(target=lambda: out.square().sum().backward())
        thread.start()
        thread.join()

    _, ran = run_recording(backward_on_a_thread)
    assert x.grad is not None and [split.plan is not None for split in ran] == [False, True, False]


def test_attention_written_with_pytorch_hints_wrapper_compiles_forward_and_backward():
    torch.manual_seed(0)
    plain = Attention()
    wrapped = Attention(wrapper_hints={"schedule": "dfs", "slices": 8, "slice_dim": 1})
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = _train_step(plain, x)  # hints_wrapper has no eager autograd: the reference runs without it
    got, ran = run_recording(lambda: _train_step(fx_compile(wrapped), x))
    _assert_close(got, expected)
    assert [split.plan.slices for split in ran if split.plan] == [8, 8]


def test_bfs_runs_the_region_whole():
    model = Attention(hints={"schedule": "bfs"})
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        got, ran = run_recording(lambda: fx_compile(model)(x))
        torch.testing.assert_close(got, model(x))
    assert [split.plan for split in ran] == [None, None, None]  # the region is a split of its own
    assert any(node.name == "_softmax" for node in ran[1].nodes)


def region_peak(compiled, x) -> int:
    """Peak bytes of the tensors created while the attention region's split runs.

    The tracker is a dispatch mode: it is entered by the split observer, since
    dynamo runs a compiled frame eagerly while a dispatch mode is active.
    """
    tracker = LiveTensorBytes()

    def track(event, split):
        if any(node.name.startswith("_softmax") for node in split.nodes):
            (tracker.__enter__ if event == "start" else lambda: tracker.__exit__(None, None, None))()

    with torch.no_grad(), observe_splits(track):
        compiled(x)
    return tracker.peak


def test_dfs_cuts_the_regions_peak_memory():
    torch.manual_seed(0)
    x = torch.randn(1, 256, 64)
    peaks = {}
    for schedule in ("bfs", "dfs"):
        compiled = fx_compile(Attention(embed=64, heads=16, hints={"schedule": schedule, "slices": 8, "slice_dim": 1}))
        with torch.no_grad():
            compiled(x)  # compile outside the measurement
        peaks[schedule] = region_peak(compiled, x)
    scores = 16 * 256 * 256 * 4
    assert peaks["bfs"] >= scores
    assert peaks["dfs"] <= peaks["bfs"] - 0.8 * (7 / 8) * scores, peaks


@pytest.mark.parametrize(
    "region, reason",
    [
        (lambda q, k, v: (q @ k.transpose(-2, -1)).softmax(1) @ v, "normalizes along the sliced dimension"),
        (lambda q, k, v: (q @ k.transpose(-2, -1)).sum(1, keepdim=True) * v.sum(), "reduces over the sliced dimension"),
        (lambda q, k, v: torch.nn.functional.dropout(q, 0.5, training=True) + k, "draws random numbers"),
        (lambda q, k, v: q.flip(1) + k, "has no slicing rule"),
    ],
)
def test_a_region_that_cannot_be_sliced_keeps_running_whole_with_the_reason_logged(region, reason, caplog):
    def fn(q, k, v):
        with tightfit.hint(schedule="dfs", slices=4, slice_dim=1):
            return region(q, k, v)

    q, k, v = (torch.randn(2, 4, 8, 8) for _ in range(3))
    torch.manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="tightfit.graph"):
        got, ran = run_recording(lambda: fx_compile(fn)(q, k, v))
    assert [split.plan for split in ran] == [None]
    assert any(reason in record.getMessage() and "ignored" in record.getMessage() for record in caplog.records), (
        caplog.text
    )
    if "random" not in reason:
        torch.testing.assert_close(got, region(q, k, v))


def test_a_region_that_cannot_be_sliced_is_an_error_in_strict_mode():
    def fn(q, k):
        with tightfit.hint(schedule="dfs", slices=4, slice_dim=1):
            return (q @ k).softmax(1)

    q = torch.randn(2, 4, 8, 8)
    with tightfit.strict(), pytest.raises(Exception) as raised:
        fx_compile(fn)(q, q)
    assert isinstance(getattr(raised.value, "inner_exception", None), tightfit.StrictModeError), raised.value
    assert "normalizes along the sliced dimension" in str(raised.value)


def test_dfs_without_slices_is_reported():
    def fn(x):
        with tightfit.hint(schedule="dfs"):
            return x * 2

    with tightfit.strict(), pytest.raises(Exception, match="it needs slices=N"):
        fx_compile(fn)(torch.ones(4, 4))


def test_uneven_slices_and_more_slices_than_elements():
    assert slice_bounds(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert slice_bounds(3, 3) == [(0, 1), (1, 1), (2, 1)]

    def fn(x, w):
        with tightfit.hint(schedule="dfs", slices=16, slice_dim=0):
            return (x @ w).relu() + 1

    x, w = torch.randn(10, 6), torch.randn(6, 5)
    got, ran = run_recording(lambda: fx_compile(fn)(x, w))
    torch.testing.assert_close(got, (x @ w).relu() + 1)
    plan = ran[0].plan
    assert plan.slices == 10 and set(plan.bodies) == {1}


def test_nodes_between_region_nodes_move_out_of_the_sliced_run():
    def fn(x, y):
        with tightfit.hint(schedule="dfs", slices=2, slice_dim=0):
            a = x.exp()
            with tightfit.hint(schedule="bfs"):  # not part of the sliced run, traced in its middle
                unrelated = y.cos()
            b = a * 2
        return b, unrelated

    x, y = torch.randn(4, 4), torch.randn(3)
    (b, unrelated), ran = run_recording(lambda: fx_compile(fn)(x, y))
    torch.testing.assert_close(b, x.exp() * 2)
    torch.testing.assert_close(unrelated, y.cos())
    assert [len(split.nodes) for split in ran if split.plan] == [2]


def test_a_region_interleaved_with_what_it_feeds_is_not_sliced(caplog):
    def fn(x):
        with tightfit.hint(schedule="dfs", slices=2, slice_dim=0):
            a = x.exp()
            with tightfit.hint(schedule="bfs"):
                middle = a.sum()  # uses the region and feeds it
            return a * middle

    x = torch.randn(4, 4)
    with caplog.at_level(logging.WARNING, logger="tightfit.graph"):
        got, ran = run_recording(lambda: fx_compile(fn)(x))
    torch.testing.assert_close(got, x.exp() * x.exp().sum())
    assert "the region is not contiguous" in caplog.text
