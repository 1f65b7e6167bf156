"""Shared fixtures: every test starts with fresh backend discovery and fresh fallback warnings;
the fit planner's calibration cache lives in a folder of the session, not the user's, and
holds the docs' figures, so that plans come out the same everywhere and no worker or child
process measures them (``measured_calibration`` measures this CPU's figures once, into a
folder of its own); the session's child
processes may cache their bytecode; ``older_objects_frozen`` keeps a measurement's garbage
collection to what its module made. The report's header names the CPU and the paths its
features select, so a run says what it covered (tests that need another path pin it
themselves)."""

from __future__ import annotations

import gc
import os

import pytest

# Where no GPU is, the Triton kernels' tests run under Triton's interpreter; it must be chosen
# before Triton is first imported.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from tightfit._strict import _forget_warnings  # noqa: E402
from tightfit.backends import registry  # noqa: E402


def pytest_report_header(config):
    import platform

    import torch

    from tightfit.ops import _cpu_int8, _native

    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
        platform.processor() or "unknown",
    )
    return (
        f"cpu: {model}; torch capability {torch.backends.cpu.get_cpu_capability()}; "
        f"int8 matmul path: {_cpu_int8._path(1)} (1 row), {_cpu_int8._path(64)} (64 rows); "
        f"native kernel path: {_native.selected_path() or 'none'}"
    )


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            return file.read()
    except OSError:
        return ""


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.delenv("TIGHTFIT_STRICT", raising=False)
    monkeypatch.delenv("TIGHTFIT_BACKEND", raising=False)
    registry._clear_cache()
    _forget_warnings()
    yield
    registry._clear_cache()
    _forget_warnings()


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory):
    from zoo.lm import cache_docs_calibration

    before = os.environ.get("TIGHTFIT_CACHE_DIR")
    os.environ["TIGHTFIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("tightfit-cache"))
    cache_docs_calibration()  # plans read the docs' figures, not this CPU's measured in each worker and child
    yield
    if before is None:
        os.environ.pop("TIGHTFIT_CACHE_DIR", None)
    else:
        os.environ["TIGHTFIT_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def measured_calibration(_calibration_cache, tmp_path_factory):
    """This CPU's figures measured once for the session (about 15 s), with the progress
    tasks shown meanwhile, cached in a folder of their own: the session's keeps the docs'."""
    from tightfit.fitting import calibration

    tasks = []
    shown = calibration.task
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path_factory.mktemp("measured-calibration")))
        patch.setattr(
            calibration, "task", lambda description, total: tasks.append(description) or shown(description, total)
        )
        figures = calibration.calibrate("cpu", remeasure=True)
    return figures, tasks


@pytest.fixture(autouse=True, scope="session")
def _children_cache_bytecode():
    """Where the environment says PYTHONDONTWRITEBYTECODE, each ``python -O`` child the tests
    start compiled torch and transformers from source again (their installed bytecode is
    for plain ``python``): about 12 s a child. The first child now writes what the others read."""
    before = os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    yield
    if before is not None:
        os.environ["PYTHONDONTWRITEBYTECODE"] = before


@pytest.fixture(scope="module")
def older_objects_frozen():
    """The objects that exist when the module starts, collected once and frozen: a
    ``gc.collect()`` before a measurement then walks only what the module made, not the
    whole session's heap (about half a second a collection). Frozen objects are never
    collected, so none of them is freed inside a measurement either."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
