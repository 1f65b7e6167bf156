"""Reading hints back from a traced graph: ``tightfit.hints_of(graph_module)``."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch.fx

from tightfit._validate import check_type
from tightfit.hints.payload import merged, payload_of

__all__ = ["Region", "hints_of", "node_hints", "node_regions", "owning_region", "where"]


@dataclass(frozen=True)
class Region:
    """One hinted region found in a graph.

    ``hints`` are those in force in the region (merged with enclosing regions, inner
    wins), ``declared`` those written on it, ``parent`` the enclosing region's id,
    ``nodes`` the names of the graph's nodes inside it (nested regions included), in
    graph order, and ``where`` the first source line that made one of them.
    """

    id: int
    hints: Mapping[str, Any]
    declared: Mapping[str, Any]
    parent: int | None
    nodes: tuple[str, ...]
    where: str | None

    def __repr__(self) -> str:
        place = f" at {self.where}" if self.where else ""
        return f"Region(id={self.id}, hints={dict(self.hints)}, nodes={len(self.nodes)}{place})"


def node_hints(node: torch.fx.Node) -> dict[str, Any]:
    """The hints in force at one node ({} outside every hinted region)."""
    payload = payload_of(node)
    return dict(payload["hints"]) if payload else {}


def node_regions(node: torch.fx.Node) -> tuple[int, ...]:
    """Ids of the regions a node sits in, outermost first."""
    payload = payload_of(node)
    return tuple(region for region, _ in payload["chain"]) if payload else ()


def owning_region(node: torch.fx.Node, keys: Collection[str]) -> int | None:
    """The id of the innermost region around ``node`` that wrote one of ``keys``, or None.

    That region owns the value in force (inner regions win), so the passes that act on
    a region (a DFS schedule, an as-written order) treat its nodes as one group.
    """
    payload = payload_of(node)
    if payload is None:
        return None
    owners = [region for region, declared in payload["chain"] if any(key in keys for key, _ in declared)]
    return owners[-1] if owners else None


def where(node: torch.fx.Node) -> str | None:
    """``file:line`` of the user code that made a node, when the tracer kept it."""
    trace = node.meta.get("stack_trace")
    if not isinstance(trace, str):
        return None
    for line in reversed(trace.strip().splitlines()):
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "') :].partition('", line ')
            return f"{path.rsplit('/', 1)[-1]}:{rest.split(',')[0]}"
    return None


def hints_of(graph_module: torch.fx.GraphModule | torch.fx.Graph) -> list[Region]:
    """Every hinted region in a graph (dynamo's, aot_autograd's forward or backward, export's).

    Regions come in the order they start in the graph, an enclosing region before the
    regions inside it.
    """
    check_type("graph_module", graph_module, (torch.fx.GraphModule, torch.fx.Graph))
    graph = graph_module.graph if isinstance(graph_module, torch.fx.GraphModule) else graph_module
    found: dict[int, dict[str, Any]] = {}
    for index, node in enumerate(graph.nodes):
        payload = payload_of(node)
        if payload is None:
            continue
        chain = payload["chain"]
        for depth, (region, declared) in enumerate(chain):
            entry = found.setdefault(
                region,
                {
                    "start": (index, depth),
                    "hints": merged(chain[: depth + 1]),
                    "declared": dict(declared),
                    "parent": chain[depth - 1][0] if depth else None,
                    "nodes": [],
                    "where": None,
                },
            )
            entry["nodes"].append(node.name)
            if entry["where"] is None:
                entry["where"] = where(node)
    return [
        Region(
            id=region,
            hints=MappingProxyType(entry["hints"]),
            declared=MappingProxyType(entry["declared"]),
            parent=entry["parent"],
            nodes=tuple(entry["nodes"]),
            where=entry["where"],
        )
        for region, entry in sorted(found.items(), key=lambda item: item[1]["start"])
    ]
