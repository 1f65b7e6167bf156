"""LLM.int8()'s outlier path: observed in a real forward, assumed on meta, and predicted to the byte."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit
from tightfit.fitting import held_bytes
from tightfit.fitting.outliers import assumed_outliers, observe_outliers
from tightfit.memory import allocated_peak, measure
from zoo.lm import figures


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 256)).eval()


def _inputs(outlier_columns: int) -> torch.Tensor:
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)).clamp(-3, 3)
    x[::7, :outlier_columns] = 8.0
    return x


def test_observed_columns_count_each_column_once():
    x = _inputs(5)
    found = observe_outliers(_model(), (x,), {}, threshold=6.0)
    assert found["0"] == 5
    assert set(found) == {"0", "2", "4"}


def test_meta_models_are_not_observed():
    with torch.device("meta"):
        model = _model()
    assert observe_outliers(model, (_inputs(5),), {}, threshold=6.0) is None
    assert assumed_outliers(256) == 8 and assumed_outliers(16) == 1


@pytest.mark.parametrize(
    "outlier_columns, dtype",
    [(0, torch.float32), (5, torch.float32), (200, torch.float32), (0, torch.bfloat16), (200, torch.bfloat16)],
)
def test_int8_prediction_matches_the_allocated_peak(outlier_columns, dtype):
    model, x = _model().to(dtype), _inputs(outlier_columns).to(dtype)
    allow = {"storage": {"keep", "int8"}, "placement": {"device"}}
    with pytest.raises(tightfit.FitError) as error:  # the least peak keep and int8 reach: every layer in int8
        tightfit.fit(model, (x,), 1024, calibration=figures(), allow=allow)
    plan = tightfit.fit(model, (x,), int(error.value.smallest_peak_bytes * 1.01), calibration=figures(), allow=allow)
    assert [e.storage for e in plan.entries if e.module in ("0", "2", "4")] == ["int8", "int8", "int8"]
    plan.apply(model)
    held = held_bytes(model, "cpu")
    with torch.inference_mode():  # the input counts too: it is on the device, made before the call
        allocated = held + x.nbytes + allocated_peak(lambda: model(x))
        live = measure(lambda: model(x), "cpu", repeat=1, baseline_bytes=held + x.nbytes).peak_bytes
    assert allocated <= plan.budget_bytes
    assert plan.predicted_peak_bytes == allocated, str(plan)
    # LLM.int8()'s forward is one op (tightfit::int8_linear, differentiable): a per-op count of live tensors sees
    # its output only, not the buffers inside it, which the prediction counts and the allocator sees
    assert live < allocated


def test_no_real_forward_when_nothing_is_quantized_to_int8(monkeypatch):
    calls = []
    monkeypatch.setattr("tightfit.fitting.planner.observe_outliers", lambda *args: calls.append(args) or {})
    model, x = _model(), _inputs(5)
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures()).full_peak_bytes
    tightfit.fit(model, (x,), int(full * 0.5), calibration=figures(), allow={"storage": {"keep", "nf4"}})
    assert calls == []  # the budget covers the model, or int8 is not allowed
    tightfit.fit(model, (x,), int(full * 0.5), calibration=figures())
    assert len(calls) == 1


def test_the_observing_forward_leaves_a_training_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.Dropout(0.5), nn.Linear(512, 256)).train()
    model[2].eval()  # a mixed model: each module's own flag comes back
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    x = _inputs(5)
    found = observe_outliers(model, (x,), {}, threshold=6.0)
    assert found["0"] == 5
    assert [m.training for m in model.modules()] == [True, True, True, False, True]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name  # running stats and num_batches_tracked untouched
    # eval mode: dropout off, so the count is the same every time
    assert all(observe_outliers(model, (x,), {}, threshold=6.0) == found for _ in range(3))


def test_fit_leaves_a_training_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.Dropout(0.5), nn.Linear(512, 256)).train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    full = tightfit.fit(model, (_inputs(5),), "1GiB", calibration=figures()).full_peak_bytes
    # on the device: at this size the CPU int8 matmul's float scratch (up to 1 MiB) makes disk mapping the cheaper cut
    allow = {"storage": {"keep", "int8"}, "placement": {"device"}}
    plan = tightfit.fit(model, (_inputs(5),), int(full * 0.8), calibration=figures(), allow=allow)
    assert plan.int8_outliers.startswith("observed")
    assert all(m.training for m in model.modules())
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_the_flags_come_back_when_the_forward_raises():
    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            raise RuntimeError("broken model")

    model = Failing().train()
    with pytest.raises(RuntimeError, match="broken model"):
        observe_outliers(model, (torch.ones(2, 4),), {}, threshold=6.0)
    assert model.training and model.linear.training


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 1000000 bytes"
        ),
    ],
)
def test_running_out_of_memory_while_observing_falls_back_to_the_assumed_bound(monkeypatch, error):
    def out_of_memory(*args):
        raise error

    monkeypatch.setattr("tightfit.fitting.planner.observe_outliers", out_of_memory)
    model, x = _model(), _inputs(5)
    allow = {"storage": {"keep", "int8"}, "placement": {"device"}}
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures()).full_peak_bytes
    plan = tightfit.fit(model, (x,), int(full * 0.6), calibration=figures(), allow=allow)
    assert any(e.storage == "int8" for e in plan.entries)
    assert plan.int8_outliers.startswith("assumed: up to 3.1%")
    assert "ran out of memory on cpu" in plan.int8_outliers


def test_other_errors_of_the_observing_forward_are_not_swallowed(monkeypatch):
    def broken(*args):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr("tightfit.fitting.planner.observe_outliers", broken)
    model, x = _model(), _inputs(5)
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures()).full_peak_bytes
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        tightfit.fit(model, (x,), int(full * 0.6), calibration=figures(), allow={"storage": {"keep", "int8"}})


class _CalledTwice(nn.Module):
    """Each Linear runs twice per forward: its int8 buffers exist per call, its time adds up."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 1024)
        self.down = nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.down(torch.relu(self.up(x)))
        return self.down(torch.relu(self.up(first)))


def test_int8_transient_of_a_layer_called_twice_counts_one_call():
    torch.manual_seed(0)
    model, x = _CalledTwice().eval(), _inputs(0)
    allow = {"storage": {"keep", "int8"}, "placement": {"device"}}
    with pytest.raises(tightfit.FitError) as error:
        tightfit.fit(model, (x,), 1024, calibration=figures(), allow=allow)
    plan = tightfit.fit(model, (x,), int(error.value.smallest_peak_bytes * 1.01), calibration=figures(), allow=allow)
    assert [e.storage for e in plan.entries] == ["int8", "int8"]
    once = tightfit.fit(model, (x,), "1GiB", calibration=figures(matmul_flops=1e9))
    twice_rows = 2 * x.shape[0]  # the time still counts both calls: 2 * weights * rows per call, twice
    assert once.entries[0].seconds >= 2 * 256 * 1024 * twice_rows / 1e9
    plan.apply(model)
    held = held_bytes(model, "cpu")
    with torch.inference_mode():
        allocated = held + x.nbytes + allocated_peak(lambda: model(x))
    assert plan.predicted_peak_bytes == allocated, str(plan)
