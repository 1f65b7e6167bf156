"""``--max-error`` on ``tightfit fit`` and ``run``: the planner's bound on a plan's expected
error, in the plan's JSON and table, refused where it cannot apply, a bound that cannot be
met named with the least error the budget allows (the built-in model, int8 and nf4 only)."""

from __future__ import annotations

import json

import pytest

from tightfit.app.cli import main
from tightfit.app.run import RunOptions
from tightfit.loading import load

ON_DEVICE = ["--allow", "keep,int8,nf4,device"]


def _plan(capsys, *arguments: str) -> dict:
    assert main(["fit", "--budget", *arguments, *ON_DEVICE, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["plan"]


def test_the_bound_given_is_in_the_plan_and_a_budget_beyond_it_is_said(capsys):
    within = _plan(capsys, "70MB", "--max-error", "20%")
    assert within["max_error"] == pytest.approx(0.2) and within["predicted_error"] < 0.03
    assert "within the bound of 20%" in within["quality"]
    forced = _plan(capsys, "62MB")  # int8 alone does not fit: 4-bit past the default bound, said so
    assert forced["max_error"] == 0.03 and forced["predicted_error"] > 0.03
    assert "above the default bound of 3%" in forced["quality"]
    assert "nf4" in {entry["storage"] for entry in forced["entries"]}


def test_a_bound_the_budget_cannot_meet_is_one_line_naming_the_least_error(capsys):
    assert main(["fit", "--budget", "70MB", "--max-error", "0.5%", *ON_DEVICE]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error
    assert "--max-error=0.5% cannot be met within --budget=" in error
    assert "the most precise plan within the budget has an expected error of 0.6" in error


@pytest.mark.parametrize("value", ["abc", "-1%", "150%", "nan", ""])
def test_a_bad_value_is_refused_by_name(capsys, value):
    assert main(["fit", "--budget", "70MB", f"--max-error={value}"]) == 2
    assert "--max-error=" in capsys.readouterr().err


def test_max_error_needs_a_budget_and_is_not_taken_with_a_plan(tmp_path):
    with pytest.raises(ValueError, match=r"max_error=0.05 bounds the fit planner.*give budget too"):
        RunOptions(max_error="5%")
    with pytest.raises(ValueError, match=r"drop .*max_error"):
        RunOptions(plan=tmp_path / "plan.json", max_error=0.05)


def test_load_refuses_a_bound_for_a_checkpoint_stored_quantized(tmp_path, monkeypatch):
    monkeypatch.setattr("tightfit.loading.stream.holds_quantized", lambda path: True)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="stored quantized already.*drop max_error"):
        load(tmp_path, "10MB", max_error=0.05)
