"""LLM.int8()'s outlier path: observed in a real forward, assumed on meta, and predicted to the byte."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit
from tightfit.fitting import held_bytes
from tightfit.fitting.outliers import assumed_outliers, observe_outliers
from tightfit.memory import measure

from fit_models import figures


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 2048)).eval()


def _inputs(outlier_columns: int) -> torch.Tensor:
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)).clamp(-3, 3)
    x[::7, :outlier_columns] = 8.0
    return x


def test_observed_columns_count_each_column_once():
    x = _inputs(5)
    found = observe_outliers(_model(), (x,), {}, threshold=6.0)
    assert found["0"] == 5
    assert set(found) == {"0", "2"}


def test_meta_models_are_not_observed():
    with torch.device("meta"):
        model = _model()
    assert observe_outliers(model, (_inputs(5),), {}, threshold=6.0) is None
    assert assumed_outliers(256) == 8 and assumed_outliers(16) == 1


@pytest.mark.parametrize("outlier_columns", [0, 5])
def test_int8_prediction_matches_the_measured_peak(outlier_columns):
    model, x = _model(), _inputs(outlier_columns)
    allow = {"storage": {"keep", "int8"}, "placement": {"device"}}
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures()).full_peak_bytes
    plan = tightfit.fit(model, (x,), int(full * 0.35), calibration=figures(), allow=allow)
    assert [e.storage for e in plan.entries if e.module in ("0", "2")] == ["int8", "int8"]
    plan.apply(model)
    held = held_bytes(model, "cpu")
    with torch.inference_mode():  # the input counts too: it is on the device, made before the call
        result = measure(lambda: model(x), "cpu", repeat=1, baseline_bytes=held + x.nbytes)
    assert result.peak_bytes <= plan.budget_bytes
    assert plan.predicted_peak_bytes == result.peak_bytes, str(plan)
