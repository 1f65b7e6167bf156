"""tightfit.plan_memory: exact figures on small models, training graphs, models larger than the
machine, predictions against measured peaks (eager and the compile backend), the report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tightfit
from tightfit.graph import compiler
from tightfit.memory import LiveTensorBytes
from tightfit.memory.compiled import compiled_peak
from zoo.graph import Attention

F32 = 4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))


def verified(plan: tightfit.MemoryPlan) -> tightfit.MemoryPlan:
    plan.verify()
    for device in plan.devices.values():
        assert device.arena_bytes >= device.lower_bound_bytes >= device.live_peak_bytes
    return plan


def test_an_mlp_plans_to_the_byte():
    plan = verified(tightfit.plan_memory(mlp(), torch.randn(16, 64)))
    cpu = plan.devices["cpu"]
    assert cpu.weights_bytes == (64 * 256 + 256 + 256 * 32 + 32) * F32
    assert cpu.inputs_bytes == 16 * 64 * F32
    assert cpu.lower_bound_bytes == cpu.arena_bytes == 2 * 16 * 256 * F32  # addmm and relu alive together
    assert cpu.peak_node == "relu" and {name for name, _, _ in cpu.largest_live} == {"addmm", "relu"}
    assert cpu.total_bytes == cpu.weights_bytes + cpu.inputs_bytes + cpu.arena_bytes
    assert plan.orders == {"inference": "written"}


def test_a_training_plan_covers_the_forward_the_backward_and_the_gradients():
    model = mlp()
    plan = verified(tightfit.plan_memory(model, torch.randn(16, 64), training=True))
    assert list(plan.orders) == ["forward", "backward"]
    assert set(plan.timeline.step_graphs) == {"forward", "backward"}
    grads = {b.name: b for b in plan.timeline.buffers if b.graph == "backward" and b.kind == "output"}
    weight_bytes = sum(p.numel() * F32 for p in model.parameters())
    assert sum(b.nbytes for b in grads.values()) == weight_bytes  # one gradient per parameter, kept to the end
    assert plan.devices["cpu"].arena_bytes >= weight_bytes + 16 * 256 * F32


@pytest.mark.parametrize("training", [False, True])
def test_a_model_far_larger_than_this_machine_plans_without_allocating_it(training):
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(65536, 65536) for _ in range(4)])  # 64 GiB of float32
    with FakeTensorMode():
        x = torch.empty(8, 65536)
    before = _rss()
    plan = verified(tightfit.plan_memory(model, x, training=training))
    cpu = plan.devices["cpu"]
    assert cpu.weights_bytes == 4 * (65536 * 65536 + 65536) * F32
    assert _rss() - before < 512 << 20
    if training:  # the gradients alone are as large as the weights
        assert cpu.arena_bytes >= cpu.weights_bytes
    else:
        assert cpu.arena_bytes == 2 * 8 * 65536 * F32


def test_a_model_built_under_fake_tensor_mode_plans_too():
    with FakeTensorMode():
        model = torch.nn.Linear(1 << 15, 1 << 15)  # 4 GiB
    plan = verified(tightfit.plan_memory(model, torch.empty(4, 1 << 15, device="meta")))
    assert plan.devices["cpu"].weights_bytes == ((1 << 30) + (1 << 15)) * F32


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _eager_peak(model, x, training):
    model.zero_grad(set_to_none=True)
    with LiveTensorBytes() as tracker:
        if training:
            model(x).square().mean().backward()
        else:
            with torch.no_grad():
                model(x)
    return tracker.peak


class WithLoss(torch.nn.Module):
    """Attention returning a scalar loss, so that a training step's backward starts from it."""

    def __init__(self, hints=None):
        super().__init__()
        self.inner = Attention(embed=64, heads=8, hints=hints)

    def forward(self, x):
        return self.inner(x).square().mean()


class Block(torch.nn.Module):
    """A pre-norm MLP block with a loss; written so that dynamo and a direct trace see the same ops.

    (Dynamo turns ``q, k, v = tensor`` into three ``select`` ops where a direct trace has
    one ``unbind``: plan_memory traces without dynamo, see docs/memory.md.)
    """

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x):
        return (x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))).square().mean()


@pytest.mark.parametrize("training", [False, True])
def test_the_eager_prediction_matches_a_real_eager_run(training):
    torch.manual_seed(0)
    model = Attention(embed=64, heads=8)
    x = torch.randn(2, 128, 64, requires_grad=training)
    plan = verified(tightfit.plan_memory(WithLoss() if training else model, x, training=training, runtime="eager"))
    if training:
        model = plan_model = WithLoss()
        plan = verified(tightfit.plan_memory(plan_model, x, training=True, runtime="eager"))
        model.zero_grad(set_to_none=True)
        with LiveTensorBytes() as tracker:
            model(x).backward()
        measured = tracker.peak
    else:
        measured = _eager_peak(model, x, False)
    predicted = plan.devices["cpu"].live_peak_bytes
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)
    assert plan.runtime == "eager" and "as written (eager runs the module as it is)" in str(plan)


@pytest.mark.parametrize("training", [False, True])
def test_the_compiled_prediction_matches_the_compile_backend_run_as_fx(training):
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 64, 64, requires_grad=training)
    plan = verified(tightfit.plan_memory(model, x, training=training, order="written"))
    compiled = torch.compile(model, backend=compiler(execution="fx"))

    def step():
        if training:
            compiled(x).backward()
        else:
            with torch.no_grad():
                compiled(x)

    step()  # compile outside the measurement
    model.zero_grad(set_to_none=True)
    assert compiled_peak(step) == plan.devices["cpu"].live_peak_bytes


class Stack(torch.nn.Module):
    """Four attention layers with residuals and a loss: the backward reads many saved activations."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(embed=64, heads=8) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def test_the_compiled_backward_frees_saved_activations_as_eager_does():
    """Each saved activation dies after its last use in the backward, not when the backward ends."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(2, 128, 64)
    model(x).backward()  # warm up
    model.zero_grad(set_to_none=True)
    with LiveTensorBytes() as tracker:
        model(x).backward()
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=compiler(execution="fx"))

    def step():
        compiled(x).backward()

    step()
    model.zero_grad(set_to_none=True)
    measured = compiled_peak(step)
    assert measured <= 1.01 * tracker.peak, (measured, tracker.peak)
    assert measured == tightfit.plan_memory(model, x, training=True, order="written").devices["cpu"].live_peak_bytes


def test_a_dfs_hint_shrinks_the_plan_to_one_slice_and_its_workspace():
    x = torch.randn(2, 256, 64)
    whole = verified(tightfit.plan_memory(Attention(embed=64, heads=8), x)).devices["cpu"]
    sliced = verified(
        tightfit.plan_memory(Attention(embed=64, heads=8, hints={"schedule": "dfs", "slices": 8, "slice_dim": 1}), x)
    )
    scores = 2 * 8 * 256 * 256 * F32
    assert whole.arena_bytes >= 2 * scores
    assert sliced.devices["cpu"].arena_bytes < whole.arena_bytes - scores
    assert any(b.kind == "scratch" for b in sliced.timeline.buffers)


class Softmaxed(torch.nn.Module):
    def forward(self, x):
        t = (x * 2).softmax(-1).exp()  # the softmax split's output is last read here
        return t.sin().cos()


def _planned_and_run_on_restricted_cpu(model, x):
    """The written-order plan and the measured compiled peak of ``model(x)`` on a CPU backend
    that refuses softmax, so that softmax runs as a split of its own (with a fallback warning)."""
    from zoo.graph import restricted_cpu

    backend = restricted_cpu()
    with pytest.warns(tightfit.FallbackWarning, match="_softmax"):
        plan = verified(tightfit.plan_memory(model, x, backend=backend, order="written"))
    compiled = torch.compile(model, backend=compiler(execution="fx", backends=[backend]))

    def step():
        with torch.no_grad():
            compiled(x)

    step()
    return plan, compiled_peak(step)


def test_a_split_output_dies_at_its_last_use_in_the_next_split():
    """The softmax (a split of its own) is freed inside the next split, not when that split returns."""
    x = torch.randn(64, 1024)
    plan, measured = _planned_and_run_on_restricted_cpu(Softmaxed(), x)
    assert measured == plan.devices["cpu"].live_peak_bytes == 2 * x.nbytes


@pytest.mark.parametrize("slices", [2, 4])
def test_a_dfs_split_is_planned_to_the_byte(slices):
    """No slice's output outlives its write into the result (it would overlap the next slice's body)."""
    torch.manual_seed(0)
    model = Attention(embed=64, heads=8, hints={"schedule": "dfs", "slices": slices, "slice_dim": 1})
    x = torch.randn(2, 128, 64)
    plan = verified(tightfit.plan_memory(model, x, order="written"))
    compiled = torch.compile(model, backend=compiler(execution="fx"))

    def step():
        with torch.no_grad():
            compiled(x)

    step()
    assert compiled_peak(step) == plan.devices["cpu"].live_peak_bytes


def test_the_report_the_dict_and_the_plot(tmp_path):
    plan = tightfit.plan_memory(mlp(), torch.randn(16, 64), training=True)
    text = str(plan)
    for expected in (
        "memory plan: Sequential, training step",
        "lower bound",
        "arena/bound",
        "peak on cpu",
        "largest tensors alive there",
        "order of the backward graph",
    ):
        assert expected in text
    data = plan.to_dict()
    json.dumps(data)
    assert data["devices"]["cpu"]["arena_bytes"] == plan.devices["cpu"].arena_bytes
    assert len(plan.live_bytes("cpu")) == len(plan.timeline.steps)
    target = tmp_path / "plan.png"
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(RuntimeError, match=r"pip install 'tightfit\[plot\]'"):
            plan.plot(target)
    else:
        assert plan.plot(target) == target and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="must end in .png"):
        plan.plot(tmp_path / "plan.svg")
    with pytest.raises(ValueError, match="does not exist"):
        plan.plot(tmp_path / "missing" / "plan.png")
    with pytest.raises(ValueError, match="not in the plan"):
        plan.live_bytes("cuda:0")


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: tightfit.plan_memory(lambda x: x, torch.ones(2)), TypeError, "model must be Module"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), training=1), TypeError, "training must be bool"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), order="random"), ValueError, "order='random'"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), runtime="jit"), ValueError, "runtime='jit'"),
        (
            lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), runtime="eager", order="depth-first"),
            ValueError,
            "eager execution runs the written order",
        ),
        (
            lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), runtime="arena", order="breadth-first"),
            ValueError,
            "arena execution runs the written order",
        ),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), alignment=48), ValueError, "power of two"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), alignment=True), TypeError, "alignment must be int"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), backend="nonesuch"), ValueError, "not known"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), backend=3), TypeError, "backend must be"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64), kwargs=[1]), TypeError, "kwargs must be Mapping"),
        (lambda: tightfit.plan_memory(mlp(), torch.ones(2, 64).to_sparse()), ValueError, "strided tensors only"),
        (
            lambda: tightfit.plan_memory(mlp().requires_grad_(False), torch.ones(2, 64), training=True),
            ValueError,
            "needs a gradient",
        ),
    ],
)
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("backend", ["cpu", torch.device("cpu"), "cpu:0"])
def test_the_backend_may_be_named_a_device_or_an_object(backend):
    from tightfit.backends.cpu import CPUBackend

    for chosen in (backend, CPUBackend()):
        plan = tightfit.plan_memory(mlp(), torch.randn(4, 64), backend=chosen)
        assert plan.backend == "cpu" and list(plan.devices) == ["cpu"]


def test_a_run_of_several_splits_is_planned_to_the_byte():
    """A backend that refuses softmax: three splits; the plan matches the split-by-split run to the byte."""
    torch.manual_seed(0)
    model = Attention(embed=64, heads=8)
    x = torch.randn(2, 64, 64)
    plan, measured = _planned_and_run_on_restricted_cpu(model, x)
    assert measured == plan.devices["cpu"].live_peak_bytes
    single = tightfit.plan_memory(model, x, order="written").devices["cpu"]
    assert plan.devices["cpu"].live_peak_bytes >= single.live_peak_bytes
