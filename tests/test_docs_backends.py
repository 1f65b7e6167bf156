"""The example plugin of docs/backends.md installs, is discovered, and registers its kernels.

The example is installed with pip into a temporary folder (never into the environment),
so the test proves what the page tells a vendor: an installed distribution with a
``tightfit.backends`` entry point is all tightfit needs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tightfit
from tightfit.backends import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "tightfit-example-backend"
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
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "--no-input", "--target", str(site), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"installing the example failed:\n{done.stdout}\n{done.stderr}"
    return site


@pytest.fixture
def with_plugin(plugin_site: Path, monkeypatch: pytest.MonkeyPatch):
    """Make the installed example discoverable here; leave discovery and kernels as they were."""
    monkeypatch.syspath_prepend(str(plugin_site))
    for op in ("cast", "cast_into"):  # the plugin records its kernels in a copy, dropped afterwards
        opdef = tightfit.ops.get_op(op)
        monkeypatch.setattr(opdef, "kernels", dict(opdef.kernels))
    registry._clear_cache()
    yield plugin_site
    registry._clear_cache()
    sys.modules.pop(MODULE, None)  # a later import registers the kernels again


def test_example_plugin_is_discovered_and_registers_kernels(with_plugin: Path) -> None:
    if hasattr(torch, "npu"):
        pytest.skip("torch.npu exists here, so the example backend would be available")
    entries = {entry.entry_point: entry for entry in tightfit.backends.all_backends()}
    assert "npu" in entries, f"entry point not found; got {sorted(entries)}"
    entry = entries["npu"]
    assert entry.error is None
    assert entry.origin == "tightfit-example-backend 0.1.0 (tightfit_example_backend:NPUBackend)"
    backend = entry.backend
    assert isinstance(backend, tightfit.backends.Backend)
    assert (backend.name, backend.device_type, backend.priority) == ("npu", "npu", 50)

    assert entry.available is False
    assert entry.error is None  # unavailable is not an error
    assert backend not in tightfit.backends.available()
    with pytest.raises(RuntimeError, match="'npu' is installed but not available on this machine"):
        tightfit.backends.get("npu")
    with pytest.raises(RuntimeError, match="not available"):
        with tightfit.backends.use("npu"):
            pass

    for op in ("cast", "cast_into"):
        kernel = tightfit.ops.get_op(op).kernels["npu"]
        assert (kernel.device_type, kernel.label, kernel.source) == ("npu", "npu copy_", MODULE)


def test_cli_lists_example_plugin(plugin_site: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin_site), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "tightfit.cli", "backends", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["conflict"] is None
    rows = {row["name"]: row for row in report["backends"]}
    assert rows["npu"]["device"] == "npu"
    assert rows["npu"]["available"] is False
    assert rows["npu"]["error"] is None
    assert rows["npu"]["from"].startswith("tightfit-example-backend 0.1.0")
