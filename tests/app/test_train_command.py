"""``tightfit train``: training steps within a budget, planned before loading, measured
against the plan (within 5%); a budget nothing meets refused before a weight is read;
bad arguments named as the user typed them."""

from __future__ import annotations

import json

import pytest

from tightfit.app.cli import main
from tightfit.app.train_command import train
from tightfit.fitting import FitError


@pytest.fixture(scope="module")
def qlora_run(tiny_llama):
    """A run with adapters at 0.2% above the least peak the planner reaches for it."""
    with pytest.raises(FitError) as caught:
        train(str(tiny_llama), "10KB", lora=4, steps=2)
    return train(str(tiny_llama), str(int(caught.value.smallest_peak_bytes * 1.002)), lora=4, steps=2)


def test_a_run_with_adapters_meets_a_tight_budget_as_predicted(qlora_run):
    plan, measured = qlora_run.plan, qlora_run.measurement
    assert plan.predicted_peak_bytes <= plan.budget_bytes < plan.full_peak_bytes
    assert plan.activations or plan.changed_entries()  # something had to give
    assert abs(measured.allocated_peak_bytes / plan.predicted_peak_bytes - 1) < 0.05
    assert len(qlora_run.losses) == 2 and qlora_run.trained_parameters > 0
    assert "next-token loss" in qlora_run.covers


def test_the_table_shows_the_plan_and_predicted_against_measured(tiny_llama, capsys):
    assert main(["train", "--model", str(tiny_llama), "--budget", "1GB", "--steps", "2"]) == 0
    shown = capsys.readouterr().out
    assert "training plan: LlamaForCausalLM" not in shown  # the objective wraps the model
    assert "training plan: CausalLMLoss on cpu" in shown
    assert "loss by step: " in shown and "the allocator's peak" in shown


def test_json_holds_the_plan_and_the_figures(tiny_llama, capsys):
    argv = ["train", "--model", str(tiny_llama), "--budget", "1GB", "--steps", "2", "--optimizer", "SGD", "--json"]
    assert main(argv) == 0  # SGD takes no default momentum: the command gives it one
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["optimizer"] == "SGD"
    assert data["plan"]["format"] == "tightfit.training-plan/1"
    assert data["predicted_peak_bytes"] == data["plan"]["predicted_peak_bytes"]
    assert abs(data["measured_peak_bytes"] / data["predicted_peak_bytes"] - 1) < 0.05
    assert len(data["losses"]) == 2


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--budget", "10KB"], "--budget=9.8 KiB (10000 B) cannot be met on cpu for a training step"),
        (["--budget", "1GB", "--steps", "1"], "--steps=1 is not accepted: an int >= 2"),
        (["--budget", "1GB", "--lr", "0"], "--lr=0.0 is not accepted: a finite number > 0"),
        (["--budget", "1GB", "--lora", "0"], "--lora=0 is not accepted: the adapters' rank"),
    ],
)
def test_bad_runs_are_one_line_errors(tiny_llama, capsys, argv, words):
    assert main(["train", "--model", str(tiny_llama), *argv]) == 2
    error = capsys.readouterr().err
    assert words in error and error.count("\n") == 1
