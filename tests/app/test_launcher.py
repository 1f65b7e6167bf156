"""The console script's launcher: OpenMP's wait policy (a brief spin, then sleep) is set
before torch loads, unless the user set one, and ``import tightfit`` leaves the
environment alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tightfit_launcher import THREAD_DEFAULTS


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_DEFAULTS}
    return {**env, **extra}


def _launch(*args: str, **extra: str) -> subprocess.CompletedProcess:
    """``tightfit ARGS`` as the console script runs it, with libgomp describing its settings."""
    return subprocess.run(
        [sys.executable, "-m", "tightfit_launcher", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(OMP_DISPLAY_ENV="VERBOSE", **extra),
    )


def _spin_count(stderr: str) -> str:
    """GOMP_SPINCOUNT as libgomp read it when torch loaded it."""
    lines = [line for line in stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    if not lines:
        pytest.skip("torch's OpenMP runtime here is not libgomp (it describes no GOMP_SPINCOUNT)")
    return lines[0].split("=")[1].strip().strip("'")


def test_the_command_loads_torch_with_a_brief_spin_then_sleep():
    done = _launch("backends", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["backends"]
    assert _spin_count(done.stderr) == THREAD_DEFAULTS["GOMP_SPINCOUNT"]


@pytest.mark.parametrize(
    ("setting", "spins"), [({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "0")]
)
def test_a_policy_the_user_set_is_kept(setting, spins):
    done = _launch("backends", "--json", **setting)
    assert done.returncode == 0, done.stderr
    assert _spin_count(done.stderr) == spins


def test_importing_tightfit_sets_no_policy():
    code = "import os, tightfit; print(os.environ.get('OMP_WAIT_POLICY'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_the_launcher_imports_nothing_heavy_before_setting_the_policy():
    code = "import sys, tightfit_launcher; print(sorted(m for m in ('torch', 'tightfit') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_console_script_starts_in_the_launcher():
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="tightfit")
    assert script.value == "tightfit_launcher:main"
