"""``tightfit backends``: the table and its JSON form."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial

import pytest

from zoo.commands import side_by_side


def tightfit_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tightfit.app.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def commands():
    """The tests' commands, each in a fresh process, started side by side."""
    with side_by_side(
        {
            "json": partial(tightfit_cli, "backends", "--json"),
            "table": partial(tightfit_cli, "backends"),
            "unknown": partial(tightfit_cli, "frobnicate"),
        }
    ) as runs:
        yield runs


def test_backends_json_lists_every_builtin(commands):
    done = commands["json"].result()
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert {"cpu", "cuda", "xpu", "mps", "hpu"} <= set(rows) or {"cpu", "rocm", "xpu", "mps", "hpu"} <= set(rows)
    assert rows["cpu"]["available"] is True and "float8_e4m3fn" in rows["cpu"]["float8 storage"]
    assert "GiB" in rows["cpu"]["memory"] and data["conflict"] is None


def test_backends_table(commands):
    done = commands["table"].result()
    assert done.returncode == 0, done.stderr
    assert "tightfit backends" in done.stdout and "cpu" in done.stdout and "priority" in done.stdout


def test_unknown_command_is_a_usage_error(commands):
    done = commands["unknown"].result()
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_human_bytes():
    from tightfit._format import human_bytes

    assert [human_bytes(v) for v in (None, 5, 1536, 90861056, 3 * 2**40)] == [
        "-",
        "5 B",
        "1.5 KiB",
        "86.7 MiB",
        "3.0 TiB",
    ]


def test_error_messages_print_brackets_intact(monkeypatch, capsys):
    """Nothing may eat parts of a message, such as an extra's name in brackets."""
    from tightfit.app import cli, run_command

    def failing_run(args, console):
        raise RuntimeError("install it with: pip install 'tightfit[hf]'")

    monkeypatch.setattr(run_command, "handle", failing_run)
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err == "tightfit run: error: install it with: pip install 'tightfit[hf]'\n"


def plan_cli(capsys, *args: str) -> tuple[int, str]:
    """``tightfit plan ...`` in this process (a subprocess would import transformers again)."""
    from tightfit.app import cli

    code = cli.main(["plan", *args])
    return code, capsys.readouterr().out


def test_plan_json_for_the_default_model(capsys):
    code, out = plan_cli(capsys, "--batch", "2", "--seq", "16", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["inputs"] == {"batch": 2, "seq": 16}
    cpu = data["devices"]["cpu"]
    assert data["model"] == "BertModel" and data["runtime"] == "compiled" and not data["training"]
    assert cpu["weights_bytes"] == 90861056  # all-MiniLM-L6-v2's float32 weights, planned without loading them
    assert 0 < cpu["lower_bound_bytes"] <= cpu["arena_bytes"] <= 1.05 * cpu["lower_bound_bytes"]


def test_plan_table_for_a_local_folder_training(tmp_path, capsys):
    from tightfit.app.models import default_model_dir

    (tmp_path / "config.json").write_text((default_model_dir() / "config.json").read_text())
    code, out = plan_cli(
        capsys, "--model", str(tmp_path), "--batch", "1", "--seq", "8", "--training", "--runtime", "eager"
    )
    assert code == 0, out
    assert "memory plan: BertModel, training step" in out and "eager" in out and str(tmp_path) in out
    assert "inputs token ids, batch 1 x 8 tokens" in out


def test_plan_of_arena_execution(capsys):
    code, out = plan_cli(capsys, "--batch", "1", "--seq", "8", "--runtime", "arena")
    assert code == 0, out
    assert "BertModel, inference, arena" in out and "execution arena of the inference graph: cpu" in out
    assert "allocated outside the arena" in out


def test_plan_bad_arguments_are_reported(capsys):
    from tightfit.app import cli

    assert cli.main(["plan", "--batch", "0"]) == 2
    assert capsys.readouterr() == ("", "tightfit plan: error: --batch must be an int >= 1, got 0\n")
    assert cli.main(["plan", "--seq", "100000"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "/nonexistent"]) == 2
    assert "is not a folder" in capsys.readouterr().err
