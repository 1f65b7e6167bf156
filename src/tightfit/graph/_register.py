"""Make ``torch.compile(model, backend="tightfit")`` work without an installed entry point.

An installed tightfit declares the backend in the ``torch_dynamo_backends`` entry-point
group. A source checkout on ``PYTHONPATH`` has no entry points, so ``import tightfit``
adds the same entry to dynamo's table of lazily loaded backends when dynamo's registry
module is imported (at once if it already is). Nothing of dynamo is imported here:
importing it costs seconds, and ``import tightfit`` stays light (D2).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from importlib.metadata import EntryPoint
from types import ModuleType
from typing import Any

__all__: list[str] = []

NAME = "tightfit"
TARGET = "tightfit.graph.backend:tightfit_backend"
_REGISTRY = "torch._dynamo.backends.registry"


def _add(registry: ModuleType) -> None:
    table = getattr(registry, "_BACKENDS", None)
    if isinstance(table, dict) and NAME not in table:
        table[NAME] = EntryPoint(name=NAME, value=TARGET, group="torch_dynamo_backends")


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _add(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds dynamo's registry module like the normal path finder, then registers on load."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _REGISTRY:
            return None
        sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def register() -> None:
    """Register the "tightfit" backend with dynamo now, or when dynamo's registry loads."""
    registry = sys.modules.get(_REGISTRY)
    if registry is not None:
        _add(registry)
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
