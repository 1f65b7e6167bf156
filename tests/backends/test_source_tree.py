"""tightfit run from a source tree that was never installed (``PYTHONPATH=src``, as on a
machine without network) has no entry points of its own: the in-tree backends must still
be there, named as what they are, and the table they come from must equal pyproject's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tightfit.backends import registry


def test_without_entry_points_the_in_tree_backends_are_known(monkeypatch):
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    registry._clear_cache()
    entries = {entry.entry_point: entry for entry in registry.all_backends()}
    assert sorted(entries) == sorted(registry.BUILTIN_BACKENDS)
    assert all(entry.error is None and "source tree" in entry.origin for entry in entries.values())
    assert registry.get("cpu").device_type == "cpu"


def test_installed_entry_points_are_not_doubled():
    registry._clear_cache()
    names = [entry.entry_point for entry in registry.all_backends()]
    assert len(names) == len(set(names))


def test_the_table_equals_pyproject():
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("no pyproject.toml beside the tests (an installed copy of the suite)")
    section = pyproject.read_text().split('[project.entry-points."tightfit.backends"]', 1)[1].split("\n[", 1)[0]
    declared = dict(re.findall(r'^(\w+) = "([\w.:]+)"', section, flags=re.MULTILINE))
    assert declared == registry.BUILTIN_BACKENDS
