"""Shared fixtures: every test starts with fresh backend discovery and fresh fallback warnings;
the fit planner's calibration cache lives in a folder of the session, not the user's."""

from __future__ import annotations

import os

import pytest

from tightfit._strict import _forget_warnings
from tightfit.backends import registry


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
    before = os.environ.get("TIGHTFIT_CACHE_DIR")
    os.environ["TIGHTFIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("tightfit-cache"))
    yield
    if before is None:
        os.environ.pop("TIGHTFIT_CACHE_DIR", None)
    else:
        os.environ["TIGHTFIT_CACHE_DIR"] = before
