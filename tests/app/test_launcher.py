"""The console script's launcher: OpenMP's wait policy (a brief spin, then sleep) is set
before torch loads, unless the user set one, and ``import tightfit`` leaves the
environment alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import pytest

from tightfit_launcher import THREAD_DEFAULTS
from zoo.commands import side_by_side

#: A wait policy the user set, and the spin count libgomp must then read.
USER_POLICIES = [({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "0")]


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


def _python(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=_env())


@pytest.fixture(scope="module")
def launched():
    """The tests' processes, each fresh, started side by side."""
    with side_by_side(
        {
            "default": partial(_launch, "backends", "--json"),
            **{str(setting): partial(_launch, "backends", "--json", **setting) for setting, _ in USER_POLICIES},
            "import tightfit": partial(
                _python, "import os, tightfit; print(os.environ.get('OMP_WAIT_POLICY'))", timeout=300
            ),
            "import the launcher": partial(
                _python,
                "import sys, tightfit_launcher; print(sorted(m for m in ('torch', 'tightfit') if m in sys.modules))",
                timeout=60,
            ),
        }
    ) as runs:
        yield runs


def _spin_count(stderr: str) -> str:
    """GOMP_SPINCOUNT as libgomp read it when torch loaded it."""
    lines = [line for line in stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    if not lines:
        pytest.skip("torch's OpenMP runtime here is not libgomp (it describes no GOMP_SPINCOUNT)")
    return lines[0].split("=")[1].strip().strip("'")


def test_the_command_loads_torch_with_a_brief_spin_then_sleep(launched):
    done = launched["default"].result()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["backends"]
    assert _spin_count(done.stderr) == THREAD_DEFAULTS["GOMP_SPINCOUNT"]


@pytest.mark.parametrize(("setting", "spins"), USER_POLICIES)
def test_a_policy_the_user_set_is_kept(launched, setting, spins):
    done = launched[str(setting)].result()
    assert done.returncode == 0, done.stderr
    assert _spin_count(done.stderr) == spins


def test_importing_tightfit_sets_no_policy(launched):
    done = launched["import tightfit"].result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"


def test_the_launcher_imports_nothing_heavy_before_setting_the_policy(launched):
    done = launched["import the launcher"].result()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_console_script_starts_in_the_launcher():
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="tightfit")
    assert script.value == "tightfit_launcher:main"
