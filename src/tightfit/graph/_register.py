"""What tightfit tells dynamo, once dynamo is imported (at once if it already is).

- The ``"tightfit"`` compile backend. An installed tightfit declares it in the
  ``torch_dynamo_backends`` entry-point group; a source checkout on ``PYTHONPATH`` has no
  entry points, so the same lazy entry is added to dynamo's table of backends.
- The frames of ``tightfit.hint`` that dynamo must run as plain Python when they are
  the outermost frame it sees (a caller that dynamo runs eagerly, such as a function it
  gave up on): compiled on their own, a returned ``annotate`` context manager does not
  survive. Called from traced code they are still traced, as they must be.

Nothing of dynamo is imported here: importing it costs seconds, and ``import tightfit``
stays light (D2). A finder on ``sys.meta_path`` waits for ``torch._dynamo`` to load.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from importlib.metadata import EntryPoint
from types import ModuleType
from typing import Any

__all__: list[str] = []

NAME = "tightfit"
TARGET = "tightfit.graph.compile:tightfit_backend"
_DYNAMO = "torch._dynamo"
logger = logging.getLogger("tightfit.graph")


def _tell_dynamo() -> None:
    registry = sys.modules.get(f"{_DYNAMO}.backends.registry")
    table = getattr(registry, "_BACKENDS", None)
    if isinstance(table, dict) and NAME not in table:
        table[NAME] = EntryPoint(name=NAME, value=TARGET, group="torch_dynamo_backends")
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError as error:  # a torch without it: hints still work from traced code
        logger.debug("tightfit: dynamo has no skip_code (%s); hint frames may be compiled on their own", error)
        return
    from tightfit.hints.scope import plain_python_frames

    for code in plain_python_frames():
        skip_code(code)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _tell_dynamo()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` like the normal path finder, and acts once it has loaded."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def register() -> None:
    """Act now if dynamo is loaded, else when it loads."""
    if _DYNAMO in sys.modules:
        _tell_dynamo()
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
