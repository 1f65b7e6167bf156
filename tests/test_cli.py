"""``tightfit backends``: the table and its JSON form."""

from __future__ import annotations

import json
import subprocess
import sys


def tightfit_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tightfit.cli", *args], capture_output=True, text=True, timeout=120)


def test_backends_json_lists_every_builtin():
    done = tightfit_cli("backends", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert {"cpu", "cuda", "xpu", "mps", "hpu"} <= set(rows) or {"cpu", "rocm", "xpu", "mps", "hpu"} <= set(rows)
    assert rows["cpu"]["available"] is True and "float8_e4m3fn" in rows["cpu"]["float8 storage"]
    assert "GiB" in rows["cpu"]["memory"] and data["conflict"] is None


def test_backends_table():
    done = tightfit_cli("backends")
    assert done.returncode == 0, done.stderr
    assert "tightfit backends" in done.stdout and "cpu" in done.stdout and "priority" in done.stdout


def test_unknown_command_is_a_usage_error():
    done = tightfit_cli("frobnicate")
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_human_bytes():
    from tightfit._format import human_bytes

    assert [human_bytes(v) for v in (None, 5, 1536, 90861056, 3 * 2**40)] == ["-", "5 B", "1.5 KiB", "86.7 MiB", "3.0 TiB"]


def test_error_messages_print_brackets_intact(monkeypatch, capsys):
    """Rich markup must not eat parts of a message, such as an extra's name in brackets."""
    from tightfit import cli

    def failing_run(args, console):
        raise RuntimeError("install it with: pip install 'tightfit[hf]'")

    monkeypatch.setattr(cli, "_run_command", failing_run)
    assert cli.main(["run"]) == 2
    assert "pip install 'tightfit[hf]'" in capsys.readouterr().out
