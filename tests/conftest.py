"""Shared fixtures: every test starts with fresh backend discovery and fresh fallback warnings."""

from __future__ import annotations

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
