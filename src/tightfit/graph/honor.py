"""Which hints each backend honors (D5): a hint a backend does not declare in
``Capabilities.hints`` is ignored with one debug log line, or raises in strict mode.

One :class:`HintLedger` lives for one graph compile. The passes ask it before acting on
a hint, and it also records hints that a pass could not carry out (a DFS rewrite it
could not prove valid), which are logged at warning level.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch.fx

from tightfit._errors import StrictModeError
from tightfit._strict import is_strict
from tightfit.backends.base import Backend, Capabilities
from tightfit.hints.read import node_hints, node_regions, where

__all__ = ["HintLedger", "logger"]

logger = logging.getLogger("tightfit.graph")


def _describe_region(node: torch.fx.Node) -> str:
    regions = node_regions(node)
    place = where(node)
    label = f"region {regions[-1]}" if regions else "a region"
    return f"{label} ({place})" if place else label


class HintLedger:
    """Decides per (node, key, backend) whether a hint is honored, and reports once."""

    def __init__(self, graph_name: str) -> None:
        self.graph_name = graph_name
        self._capabilities: dict[Backend, Capabilities] = {}  # keyed by the object: keeps it alive
        self._reported: set[tuple[Any, ...]] = set()
        self.ignored: list[str] = []  # every message, for reports and tests

    def capabilities(self, backend: Backend) -> Capabilities:
        """``backend.capabilities()``, read once per compile."""
        if backend not in self._capabilities:
            self._capabilities[backend] = backend.capabilities()
        return self._capabilities[backend]

    def honored(self, node: torch.fx.Node, key: str, backend: Backend) -> bool:
        """True if ``backend`` declares ``key``; otherwise report (once) and return False."""
        if key in self.capabilities(backend).hints:
            return True
        value = node_hints(node).get(key)
        region = _describe_region(node)
        self._report(
            ("unhonored", node_regions(node)[-1:], key, backend.name),
            logging.DEBUG,
            f"hint {key}={value!r} on {region} is not honored by backend {backend.name}; ignored",
        )
        return False

    def check_all(self, nodes: Iterable[torch.fx.Node], backend_of: dict[torch.fx.Node, Backend]) -> None:
        """Check every hint on every assigned node against the backend that runs it."""
        for node in nodes:
            backend = backend_of.get(node)
            if backend is None:
                continue
            for key in node_hints(node):
                self.honored(node, key, backend)

    def not_applied(self, node: torch.fx.Node, what: str, reason: str) -> None:
        """A hint that is honored in principle but could not be carried out here."""
        region = _describe_region(node)
        self._report(
            ("not-applied", node_regions(node)[-1:], what, reason),
            logging.WARNING,
            f"{what} on {region} ignored: {reason}",
        )

    def _report(self, key: tuple[Any, ...], level: int, message: str) -> None:
        if key in self._reported:
            return
        self._reported.add(key)
        message = f"tightfit ({self.graph_name} graph): {message}"
        if is_strict():
            raise StrictModeError(message + " (strict mode forbids ignoring a hint)")
        self.ignored.append(message)
        logger.log(level, message)
