"""What ``tightfit run`` prints, and when: the model, the backend and a budget's plan the
moment the plan is made (flushed, before any weight is read, also where stdout is a
pipe), the rest after the run; with ``--json`` one JSON document on stdout and nothing
else."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial

import pytest

from zoo.commands import side_by_side

#: The real command, its loader marking on file descriptor 1, past Python's buffer, where
#: loading begins: what the command printed and flushed before comes before the mark in
#: the piped output, what it had only buffered comes after.
MARKED = """
import os
import sys

import tightfit.app.run as job

loader = job.load


def marked(*args, **kwargs):
    os.write(1, b"<loading begins>\\n")
    return loader(*args, **kwargs)


job.load = marked
from tightfit.app.cli import main

sys.exit(main(sys.argv[1:]))
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def commands(tiny_llama):
    """The two real runs the tests read, each in a fresh process, started side by side."""
    run = ["run", "--model", str(tiny_llama), "--budget", "4MB", "--repeat", "1"]
    with side_by_side(
        {
            "marked": partial(_python, "-c", MARKED, *run, "--max-new-tokens", "3"),
            "json": partial(_python, "-m", "tightfit.app.cli", *run, "--max-new-tokens", "2", "--json"),
        }
    ) as runs:
        yield runs


def test_the_plan_is_printed_before_loading_with_stdout_piped(commands):
    done = commands["marked"].result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("<loading begins>\n") == 1, done.stdout
    before, after = done.stdout.split("<loading begins>\n")
    lines = before.splitlines()
    assert lines[0].startswith("model    ") and lines[0].endswith("(causal LM)")
    assert lines[1] == "backend  cpu (cpu)"
    assert "last decode step" in before and "KV cache (model) at 19 positions 4.8 KiB (4,864 B) inside it" in before
    assert "fit plan: LlamaForCausalLM on cpu" in before and lines[-1].startswith("(rest)")  # the whole plan
    assert "fit plan:" not in after and "backend  cpu" not in after  # printed once
    order = ["greedy generation", "measured", "budget: predicted against measured", "the prediction covers"]
    positions = [after.index(title) for title in order]
    assert positions == sorted(positions), after


def test_json_is_one_document_on_stdout_and_nothing_else(commands):
    done = commands["json"].result()
    assert done.returncode == 0 and done.stderr == "", done.stderr
    data = json.loads(done.stdout)  # the whole of stdout: the plan is inside, not printed before
    assert data["plan"]["model"] == "LlamaForCausalLM" and data["within_budget"] is True


def test_a_run_without_a_budget_prints_its_header_once(capsys):
    from tightfit.app.cli import main

    assert main(["run", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model    all-MiniLM-L6-v2 (built-in default)\nbackend  cpu (cpu)\n")
    assert out.count("backend  cpu") == 1 and "most similar sentence pairs" in out


def test_a_reader_that_leaves_early_stops_the_command_quietly():
    """``tightfit backends --json | head -0``: the pipe closes before the command writes; it
    stops with the status a shell gives a command SIGPIPE killed, and says nothing."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tightfit.app.cli", "backends", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    process.stdout.close()  # before the command has imported torch, let alone written
    assert process.wait(timeout=600) == 141
    assert process.stderr.read() == ""
