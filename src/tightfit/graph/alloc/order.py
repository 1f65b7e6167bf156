"""Ordering: memory-aware topological orders of a run of nodes, and the choice among them.

Candidates: the written order, a depth-first order (each output's producers finished
before the next output's start, so one branch's intermediates die before the next
branch is born), a breadth-first order (by depth from the inputs), and least peak
first (a ready node that adds the fewest bytes, net of what it frees, runs next). The
caller measures each candidate's peak and keeps the lowest; the written order wins ties.

What never moves:
- a region hinted ``order="as_written"``: its nodes stay together, in their order;
- the order of ops that draw random numbers (the same numbers as eager);
- an in-place write against the other readers of what it writes;
- ops that are not aten ops (and not ``getitem``): everything stays on its side of them.
"""

from __future__ import annotations

import heapq
import operator
import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.fx

from tightfit._deprecation import renamed
from tightfit._validate import check_choice, check_type
from tightfit.graph import _nodes
from tightfit.graph.alloc.liveness import Storages, check_order
from tightfit.hints.read import node_hints, owning_region

__all__ = ["TOPOLOGICAL_ORDERS", "apply_order", "candidate_orders", "canonical_order", "choose_order", "units_of"]

#: Candidate orders, the written one first (it wins ties). Named in full: "dfs" and "bfs"
#: are the values of the ``schedule`` hint, which slices a region (a different thing).
TOPOLOGICAL_ORDERS = ("written", "depth-first", "breadth-first", "least-peak")
#: The names these orders had before: accepted, with a DeprecationWarning, for one release.
_RENAMED = {"dfs": "depth-first", "bfs": "breadth-first"}

Unit = tuple[torch.fx.Node, ...]


def _as_written_owner(node: torch.fx.Node) -> int | None:
    if node_hints(node).get("order") != "as_written":
        return None
    return owning_region(node, ("order",))


def units_of(segment: Sequence[torch.fx.Node], fixed: Sequence[Sequence[torch.fx.Node]] = ()) -> list[Unit]:
    """The segment cut into units that move as one: as-written regions, the ``fixed`` runs, single nodes."""
    fixed_of = {node: index for index, run in enumerate(fixed) for node in run}
    units: list[list[torch.fx.Node]] = []
    last_key = None
    for node in segment:
        key = ("fixed", fixed_of[node]) if node in fixed_of else ("region", _as_written_owner(node))
        if key[1] is not None and key == last_key:
            units[-1].append(node)
        else:
            units.append([node])
        last_key = key
    return [tuple(unit) for unit in units]


def _is_barrier(node: torch.fx.Node) -> bool:
    return not isinstance(node.target, torch._ops.OpOverload) and node.target is not operator.getitem


def _dependencies(units: Sequence[Unit], found: Storages) -> list[set[int]]:
    """For each unit, the units that must run before it."""
    unit_of = {node: index for index, unit in enumerate(units) for node in unit}
    deps: list[set[int]] = [set() for _ in units]
    readers: dict[int, list[int]] = {}  # storage -> units that touch it, in written order
    last_barrier, last_random = None, None
    for index, unit in enumerate(units):
        for node in unit:
            for arg in _nodes.input_nodes(node):
                if arg in unit_of and unit_of[arg] != index:
                    deps[index].add(unit_of[arg])
            if _is_barrier(node):
                deps[index].update(range(index))
                last_barrier = index
            elif last_barrier is not None:
                deps[index].add(last_barrier)
            if torch.Tag.nondeterministic_seeded in _nodes.tags(node):
                if last_random is not None:
                    deps[index].add(last_random)
                last_random = index
            touched = set(found.refs.get(node, ()))
            for arg in _nodes.input_nodes(node):
                touched.update(found.refs.get(arg, ()))
            for sid in touched:
                readers.setdefault(sid, []).append(index)
    for index, unit in enumerate(units):
        for node in unit:
            target = node.target
            if not (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable):
                continue
            for sid in found.refs.get(node, ()):  # what an in-place op writes it also returns
                for other in readers.get(sid, ()):
                    if other < index:
                        deps[index].add(other)
                    elif other > index:
                        deps[other].add(index)
    for index in range(len(units)):
        deps[index].discard(index)
    return deps


def _depth_first(units: Sequence[Unit], deps: Sequence[set[int]]) -> list[int]:
    users: list[set[int]] = [set() for _ in units]
    for index, before in enumerate(deps):
        for dep in before:
            users[dep].add(index)
    sinks = [index for index in range(len(units)) if not users[index]]
    done: set[int] = set()
    order: list[int] = []
    for sink in sinks:
        stack = [(sink, iter(sorted(deps[sink])))]
        while stack:
            index, pending = stack[-1]
            child = next((dep for dep in pending if dep not in done), None)
            if child is None:
                stack.pop()
                if index not in done:
                    done.add(index)
                    order.append(index)
            else:  # the dependencies form a DAG: no child is on the stack already
                stack.append((child, iter(sorted(deps[child]))))
    return order


def _breadth_first(units: Sequence[Unit], deps: Sequence[set[int]]) -> list[int]:
    level = [0] * len(units)
    for index in range(len(units)):  # units are in a valid (written) order
        level[index] = 1 + max((level[dep] for dep in deps[index]), default=-1)
    return sorted(range(len(units)), key=lambda index: (level[index], index))


def _least_peak(
    units: Sequence[Unit], deps: Sequence[set[int]], found: Storages, escaping: set[int], released: set[int]
) -> list[int]:
    """Greedy: the ready unit whose bytes born minus bytes freed is smallest runs next."""
    born: list[set[int]] = [set() for _ in units]
    reads: list[set[int]] = [set() for _ in units]
    for index, unit in enumerate(units):
        for node in unit:
            born[index].update(sid for sid in found.refs.get(node, ()) if found.kind[sid] == "new")
            for arg in _nodes.input_nodes(node):
                chosen = found.refs.get(node, ()) if node.target is operator.getitem else found.refs.get(arg, ())
                reads[index].update(sid for sid in chosen if found.kind[sid] == "new" or sid in released)
    for index in range(len(units)):
        reads[index] -= born[index]
    readers_left: dict[int, int] = {}
    for index in range(len(units)):
        for sid in reads[index]:
            readers_left[sid] = readers_left.get(sid, 0) + 1
    waiting = [len(before) for before in deps]
    users: list[list[int]] = [[] for _ in units]
    for index, before in enumerate(deps):
        for dep in before:
            users[dep].append(index)

    def cost(index: int) -> int:
        grown = sum(found.nbytes[sid] for sid in born[index])
        freed = sum(found.nbytes[sid] for sid in reads[index] if readers_left[sid] == 1 and sid not in escaping)
        freed += sum(found.nbytes[sid] for sid in born[index] if sid not in readers_left and sid not in escaping)
        return grown - freed

    ready = [(cost(index), index) for index in range(len(units)) if not waiting[index]]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(index)
        for sid in reads[index]:
            readers_left[sid] -= 1
        for user in users[index]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (cost(user), user))
        # costs of ready units may have changed (a read they share was freed): refresh them
        ready = [(cost(entry), entry) for _, entry in ready]
        heapq.heapify(ready)
    return order


def candidate_orders(
    segment: Sequence[torch.fx.Node],
    found: Storages,
    *,
    escaping: set[int] = frozenset(),
    released: set[int] = frozenset(),
    fixed: Sequence[Sequence[torch.fx.Node]] = (),
) -> dict[str, list[torch.fx.Node]]:
    """Every candidate order of ``segment`` (a run of ops, in a valid order), by name.

    ``escaping``: storages read after the segment or returned (never freed inside it);
    ``released``: input storages freed after their last use (handed over by an earlier
    graph); ``fixed``: runs of nodes that must stay together, as they are.
    """
    units = units_of(segment, fixed)
    deps = _dependencies(units, found)
    picks = {
        "written": list(range(len(units))),
        "depth-first": _depth_first(units, deps),
        "breadth-first": _breadth_first(units, deps),
        "least-peak": _least_peak(units, deps, found, set(escaping), set(released)),
    }
    orders = {}
    for name, indices in picks.items():
        if sorted(indices) != list(range(len(units))):
            raise RuntimeError(f"tightfit: the {name} order lost or repeated nodes (a bug)")
        orders[name] = [node for index in indices for node in units[index]]
    return orders


def canonical_order(order: object) -> str:
    """``order`` checked as an ``order`` argument: "best" or one of :data:`TOPOLOGICAL_ORDERS`;
    the old names "dfs" and "bfs" give their new name with a DeprecationWarning (blamed on
    the caller of the function that checks). Raises TypeError or ValueError naming what is
    accepted."""
    check_type("order", order, str)
    if order in _RENAMED:
        warnings.warn(
            f"order={order!r} is deprecated; use order={_RENAMED[order]!r} (a topological order; "
            f"{order!r} is a schedule hint, which slices a region)",
            DeprecationWarning,
            stacklevel=3,
        )
        return _RENAMED[order]
    check_choice("order", order, ("best", *TOPOLOGICAL_ORDERS))
    return order


def choose_order(peaks: Mapping[str, int]) -> str:
    """The name of the order with the lowest peak; the written order (then TOPOLOGICAL_ORDERS' order) wins ties."""
    if not peaks:
        raise ValueError("choose_order needs at least one candidate")
    rank = {name: index for index, name in enumerate(TOPOLOGICAL_ORDERS)}
    return min(peaks, key=lambda name: (peaks[name], rank.get(name, len(rank))))


def apply_order(graph: torch.fx.Graph, order: Sequence[torch.fx.Node]) -> None:
    """Move ``graph``'s ops into ``order`` (a valid order of all of them; placeholders stay first)."""
    order = check_order(graph, order)
    output = next(node for node in graph.nodes if node.op == "output")
    for node in order:
        output.prepend(node)
    graph.lint()


__getattr__ = renamed(
    __name__, ORDERS=("TOPOLOGICAL_ORDERS (dfs, bfs: depth-first, breadth-first)", lambda: TOPOLOGICAL_ORDERS)
)
