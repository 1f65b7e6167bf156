"""The example plugin of docs/backends.md installs, is discovered, and registers its kernels.

The example is installed with pip into a temporary folder (never into the environment),
so the test proves what the page tells a vendor: an installed distribution with a
``tightfit.backends`` entry point is all tightfit needs.

Importing the plugin names torch's PrivateUse1 device "npu" for the rest of the process
and torch cannot undo that (``"privateuseone"`` then parses as ``npu``), so every check
that imports the plugin runs in a fresh interpreter, never in the pytest process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from zoo.commands import side_by_side

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "docs" / "examples" / "tightfit-example-backend"
PAGE = HERE.parent / "docs" / "backends.md"
MODULE = "tightfit_example_backend"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example installed into its own folder, as ``pip install --target`` lays it out."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in this environment")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed, so the example cannot be built without build isolation")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = shutil.copytree(EXAMPLE, tmp_path_factory.mktemp("source") / EXAMPLE.name)
    site = tmp_path_factory.mktemp("site")
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "--no-input",
        "--target",
        str(site),
        str(source),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"installing the example failed:\n{done.stdout}\n{done.stderr}"
    return site


def _run_fresh(args: list[str], site: Path) -> subprocess.CompletedProcess:
    """Run ``python <args>`` in a fresh interpreter that sees the installed example."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(HERE), env.get("PYTHONPATH")]))
    for name in ("TIGHTFIT_BACKEND", "TIGHTFIT_STRICT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def fresh_runs(plugin_site: Path):
    """The tests' fresh interpreters, started side by side."""
    with side_by_side(
        {
            "discovery": partial(
                _run_fresh, ["-c", "import test_docs_backends as t; t.check_discovery()"], plugin_site
            ),
            "json": partial(_run_fresh, ["-m", "tightfit.app.cli", "backends", "--json"], plugin_site),
            "table": partial(_run_fresh, ["-m", "tightfit.app.cli", "backends"], plugin_site),
        }
    ) as runs:
        yield runs


def check_discovery() -> None:
    """The in-process checks; run by the test below in a fresh interpreter."""
    import torch

    import tightfit
    from tightfit.backends import registry

    registry._clear_cache()  # the plugin folder is on sys.path now: look again
    entries = {entry.entry_point: entry for entry in tightfit.backends.all_backends()}
    assert "npu" in entries, f"entry point not found; got {sorted(entries)}"
    entry = entries["npu"]
    assert entry.error is None, entry.error
    assert entry.origin == "tightfit-example-backend 0.1.0 (tightfit_example_backend:NPUBackend)", entry.origin
    backend = entry.backend
    assert isinstance(backend, tightfit.backends.Backend)
    assert (backend.name, backend.device_type, backend.priority) == ("npu", "npu", 50)
    assert backend.device(1) == torch.device("npu", 1)

    assert not hasattr(torch, "npu")  # no vendor extension here, so
    assert entry.available is False and entry.error is None  # unavailable, and that is no error
    assert backend not in tightfit.backends.available()
    for name in ("npu", "npu:0"):
        try:
            tightfit.backends.get(name)
        except RuntimeError as error:
            assert "'npu' is installed but not available on this machine" in str(error), error
        else:
            raise AssertionError(f"get({name!r}) returned a backend that is not available")

    for op in ("cast", "cast_into"):
        kernel = tightfit.ops.get_op(op).kernels["npu"]
        assert (kernel.device_type, kernel.label, kernel.source) == ("npu", "npu copy_", MODULE), kernel
    print("discovery ok")


def test_example_plugin_is_discovered_and_registers_kernels(fresh_runs) -> None:
    done = fresh_runs["discovery"].result()
    assert done.returncode == 0 and "discovery ok" in done.stdout, done.stdout + done.stderr


def test_cli_lists_example_plugin(fresh_runs) -> None:
    done = fresh_runs["json"].result()
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["conflict"] is None
    rows = {row["name"]: row for row in report["backends"]}
    assert "npu" in rows, f"not listed: {sorted(rows)}"
    assert rows["npu"]["device"] == "npu"
    assert rows["npu"]["available"] is False
    assert rows["npu"]["error"] is None
    assert rows["npu"]["from"] == "tightfit-example-backend 0.1.0 (tightfit_example_backend:NPUBackend)"


def test_page_shows_the_example_verbatim() -> None:
    """docs/backends.md embeds the example's files; they must not drift apart."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    for path in ("pyproject.toml", f"{MODULE}/__init__.py"):
        assert (EXAMPLE / path).read_text() in blocks, f"docs/backends.md does not show {path} as it is"


def test_page_shows_the_backends_table(fresh_runs) -> None:
    """docs/backends.md's ``tightfit backends`` table is what the command prints with the
    example installed (compared as tests/test_docs_examples.py compares every shown output:
    the machine's free and total memory masked)."""
    from test_docs_examples import assert_shows, page_blocks

    import tightfit

    if [backend.name for backend in tightfit.backends.available()] != ["cpu"]:
        pytest.skip("lists this machine's backends; the page's machine had the CPU only")
    (block,) = [b for b in page_blocks("docs/backends.md") if b.lang == "console" and "$ tightfit backends" in b.text]
    shown = block.text.split("$ tightfit backends\n", 1)[1]
    done = fresh_runs["table"].result()
    assert done.returncode == 0, done.stdout + done.stderr
    assert_shows(str(block), shown, done.stdout + done.stderr)
