"""``tightfit run --plan FILE``: a plan made before (``tightfit fit --json``) carried out as it
is, with its budget and its KV cache reservation; what does not match it is refused before
any weight is read."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from tightfit.app.cli import main
from tightfit.app.run import RunOptions, run


@pytest.fixture(scope="module")
def saved_plan(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    argv = ["fit", "--model", str(tiny_llama), "--budget", "4MB", "--context", "30", "--max-new-tokens", "3", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    path.write_text(out.getvalue())
    return path


def test_a_saved_plan_runs_as_made_and_within_its_budget(tiny_llama, saved_plan):
    made = json.loads(saved_plan.read_text())
    report = run(RunOptions(model=str(tiny_llama), plan=str(saved_plan), max_new_tokens=5, repeat=1, reference=False))
    assert report.budgeted.plan.to_dict() == made["plan"] and report.budgeted.context == made["context"] == 30
    assert report.budget_bytes == 4_000_000
    assert report.measurement.peak_bytes <= report.predicted_peak_bytes <= report.budget_bytes


def test_the_plan_alone_as_to_json_writes_it_runs_too(tiny_llama, saved_plan, tmp_path):
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps(json.loads(saved_plan.read_text())["plan"]))
    options = RunOptions(model=str(tiny_llama), plan=str(alone), max_new_tokens=2)
    assert options.budget == 4_000_000 and options.plan.kv_cache["context"] == 30


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            dict(budget="4MB"),
            r"plan carries out a plan made before, with its own budget, placements and context; drop budget",
        ),
        (dict(max_new_tokens=20), r"the plan's KV cache holds 30 positions; this run reaches \d+"),
    ],
)
def test_what_the_plan_does_not_cover_is_refused(tiny_llama, saved_plan, extra, message):
    with pytest.raises(ValueError, match=message):
        run(RunOptions(model=str(tiny_llama), plan=str(saved_plan), **{"max_new_tokens": 3, **extra}))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{}", r"holds no tightfit plan .* write one with tightfit fit --json"),
        ("not json", r"is not valid JSON"),
        ('{"plan": {"format": "tightfit.plan/1", "budget_bytes": -1}}', r"holds no tightfit plan"),
    ],
)
def test_a_file_that_holds_no_plan_is_named(tmp_path, content, message):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        RunOptions(plan=str(path))


def test_the_cli_says_it_in_one_line(tiny_llama, saved_plan, capsys):
    assert main(["run", "--model", str(tiny_llama), "--plan", str(saved_plan), "--allow", "keep"]) == 2
    assert capsys.readouterr().err.strip().endswith("drop --allow")
