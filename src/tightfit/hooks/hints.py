"""Region hints as a module hook: a module's ``forward`` runs inside ``tightfit.hint(...)``.

Through the hook registry rather than a wrapper of its own, so that a module with hints,
layerwise casting and offloading has one ``forward`` wrapper, and the hint region
encloses the other hooks (order 5) however the three were applied. The region is
entered inside the registry's wrapper, which dynamo traces, so compiled graphs carry the
hints; eagerly it changes nothing (docs/hints.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tightfit.hints.scope import hint
from tightfit.hooks.registry import ModuleHook

__all__ = ["REGION_HINTS", "HintHook"]

#: Name of the hint hook in a module's :class:`~tightfit.hooks.HookRegistry`.
REGION_HINTS = "tightfit.hints"


class HintHook(ModuleHook):
    """Runs what it encloses inside ``tightfit.hint(**hints)`` (``hints`` validated already)."""

    order = 5

    def __init__(self, hints: dict[str, Any]) -> None:
        self.hints = dict(hints)

    def __repr__(self) -> str:
        return f"HintHook({self.hints})"

    def around(self, module: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        with hint(**self.hints):
            return call(*args, **kwargs)
