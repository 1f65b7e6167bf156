"""The quality term: a plan's expected error, bounded by ``max_error`` (default 3%),
never traded for speed past the bound, and said where the budget forces it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import tightfit
from tightfit.fitting import FitError, FitPlan
from tightfit.fitting.quality import DEFAULT_MAX_ERROR, parse_error
from tightfit.quant import storage_format
from zoo.lm import figures

X = torch.randn(8, 256)
# int8 decodes more slowly than nf4, nf4 for free and disk is slow: unbounded, nf4 on the device is the fastest way to fit
FIGURES = figures(
    decode_seconds={"bfloat16": 1e-7, "float8": 1e-7, "8bit": 1e-7, "int8": 2e-8, "nf4": 0, "fp4": 0},
    disk_bandwidth=1e7,
)
ANY_PLACE = {"storage": {"keep", "int8", "nf4"}, "placement": {"device", "disk"}}
ON_DEVICE = {"storage": {"keep", "int8", "nf4"}, "placement": {"device"}}
UNIT = 256 * 256 * 4


def twelve_linears() -> nn.Module:
    """Twelve 256 KiB units: a decoded copy (one unit) matters less than what 4 bits save."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(12))).eval()


def _error(plan: FitPlan) -> float:
    """The expected error recomputed from the entries: each unit is one 256 x 256 weight."""
    return math.sqrt(sum(storage_format(e.storage).noise ** 2 for e in plan.entries) / len(plan.entries))


def test_the_default_bound_keeps_4_bit_out_where_disk_meets_the_budget():
    model = twelve_linears()
    fast = tightfit.fit(model, (X,), 3 * UNIT, allow=ANY_PLACE, calibration=FIGURES, max_error=1.0)
    assert "nf4" in {e.storage for e in fast.entries}
    bounded = tightfit.fit(model, (X,), 3 * UNIT, allow=ANY_PLACE, calibration=FIGURES)
    assert "nf4" not in {e.storage for e in bounded.entries}
    assert bounded.predicted_error == pytest.approx(_error(bounded)) and bounded.predicted_error <= DEFAULT_MAX_ERROR
    assert fast.predicted_error == pytest.approx(_error(fast)) and fast.predicted_error > DEFAULT_MAX_ERROR
    assert bounded.predicted_seconds > fast.predicted_seconds  # the bound costs time, as it should
    assert bounded.max_error == DEFAULT_MAX_ERROR and "within the default bound of 3%" in bounded.quality
    assert f"quality: {bounded.quality}" in str(bounded)


def test_a_bound_given_is_never_exceeded_and_the_error_names_what_the_budget_allows():
    with pytest.raises(
        FitError,
        match=r"max_error=3% cannot be met.*most precise plan within the budget has an expected error of 8\.81%.*max_error=8\.9%",
    ):
        tightfit.fit(twelve_linears(), (X,), 3 * UNIT, allow=ON_DEVICE, calibration=FIGURES, max_error="3%")


def test_the_default_bound_gives_way_to_the_budget_and_says_so():
    plan = tightfit.fit(twelve_linears(), (X,), 3 * UNIT, allow=ON_DEVICE, calibration=FIGURES)
    assert plan.predicted_error > DEFAULT_MAX_ERROR and plan.predicted_peak_bytes <= 3 * UNIT
    assert "above the default bound of 3%" in plan.quality and "most precise one that fits" in plan.quality
    assert [e.storage for e in plan.entries].count("int8") == 1  # all that fits beside 4-bit


def test_a_bigger_budget_never_gives_a_worse_model_past_the_bound():
    model = twelve_linears()
    errors = []
    for budget in range(3 * UNIT // 2, 13 * UNIT, UNIT // 2):
        for allow in (ANY_PLACE, ON_DEVICE):
            try:
                plan = tightfit.fit(model, (X,), budget, allow=allow, calibration=FIGURES)
            except FitError:
                continue
            assert plan.predicted_peak_bytes <= budget
            errors.append((allow is ANY_PLACE, budget, plan.predicted_error))
    assert len(errors) > 20
    for place in (True, False):
        series = [error for p, _, error in errors if p == place]
        for smaller, bigger in zip(series, series[1:]):
            assert bigger <= max(smaller, DEFAULT_MAX_ERROR) + 1e-9
        forced = [error for error in series if error > DEFAULT_MAX_ERROR]
        assert forced == sorted(forced, reverse=True)  # forced plans lose less as the budget grows


def test_json_keeps_the_quality_term():
    plan = tightfit.fit(twelve_linears(), (X,), 3 * UNIT, allow=ON_DEVICE, calibration=FIGURES)
    again = FitPlan.from_json(plan.to_json())
    assert again == plan and again.predicted_error == plan.predicted_error and again.quality == plan.quality


@pytest.mark.parametrize(
    ("given_value", "expected"), [(0.03, 0.03), ("3%", 0.03), (" 12.5% ", 0.125), ("0", 0.0), (1, 1.0)]
)
def test_max_error_is_a_fraction_or_a_percentage(given_value, expected):
    assert parse_error(given_value) == pytest.approx(expected)


@given(
    st.one_of(
        st.floats().filter(lambda v: not 0 <= v <= 1),
        st.text().filter(lambda t: not _reads_as_fraction(t)),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=2),
    )
)
def test_bad_max_error_is_refused_by_name(value):
    with pytest.raises((TypeError, ValueError), match="max_error"):
        tightfit.fit(twelve_linears(), (X,), 3 * UNIT, calibration=FIGURES, max_error=value) if value is not None else (
            parse_error(value)
        )


def _reads_as_fraction(text: str) -> bool:
    try:
        parse_error(text)
    except (TypeError, ValueError):
        return False
    return True
