"""Splits: maximal runs of nodes on one backend, each a GraphModule of its own.

A split ends where the backend or device changes, around a region with a ``schedule``
hint (a DFS region's sliced run loops over slices on its own; a BFS region runs whole,
as a split of its own too, so the two are measured alike), and around a region whose
``order="as_written"`` hint is honored (it runs uninterpreted by a compiler). A split's
inputs that live on another device are copied there when it runs.

Each split keeps its FX graph with fake-tensor metadata on every node (``Split.graph_module``),
which is what a static memory planner reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from tightfit.backends.base import Backend
from tightfit.graph import _nodes
from tightfit.graph._extract import extract, runtime_layout
from tightfit.graph.assign import Assignment
from tightfit.graph.honor import HintLedger
from tightfit.graph.schedules import SliceSchedule, schedule_region
from tightfit.hints.read import node_hints, owning_region

__all__ = ["Split", "partition"]


@dataclass
class Split:
    """One run of nodes on one backend and device."""

    index: int
    backend: Backend
    device: torch.device
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = field(default_factory=list)
    outputs: list[torch.fx.Node] = field(default_factory=list)
    copies: dict[torch.fx.Node, torch.device] = field(default_factory=dict)  # input -> the device it comes from
    plan: SliceSchedule | None = None
    as_written: bool = False
    graph_module: torch.fx.GraphModule | None = None  # whole splits; a DFS split has plan.bodies

    @property
    def schedule(self) -> str:
        if self.plan is not None:
            return self.plan.describe()
        return "whole" + (", order as written" if self.as_written else "")


def _as_written_region(node: torch.fx.Node, backend: Backend, ledger: HintLedger) -> int | None:
    if node_hints(node).get("order") != "as_written" or "order" not in ledger.capabilities(backend).hints:
        return None
    return owning_region(node, ("order",))


def _scheduled_region(node: torch.fx.Node, backend: Backend, ledger: HintLedger) -> int | None:
    if "schedule" not in node_hints(node) or "schedule" not in ledger.capabilities(backend).hints:
        return None
    return schedule_region(node)


def _runs(
    graph: torch.fx.Graph,
    assignment: dict[torch.fx.Node, Assignment],
    plans: Sequence[SliceSchedule],
    ledger: HintLedger,
) -> list[Split]:
    plan_of = {node: plan for plan in plans for node in plan.nodes}
    splits: list[Split] = []
    last_key = None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        where = assignment[node]
        plan = plan_of.get(node)
        key = (
            where.backend.name,
            where.device,
            id(plan) if plan else None,
            None if plan else _as_written_region(node, where.backend, ledger),
            None if plan else _scheduled_region(node, where.backend, ledger),
        )
        if key != last_key:
            splits.append(Split(len(splits), where.backend, where.device, [], plan=plan, as_written=key[3] is not None))
            last_key = key
        splits[-1].nodes.append(node)
    return splits


def _connect(splits: list[Split], assignment: dict[torch.fx.Node, Assignment]) -> None:
    """Inputs, outputs and copies of every split."""
    owner = {node: split for split in splits for node in split.nodes}
    for split in splits:
        inside = set(split.nodes)
        for node in split.nodes:
            for arg in _nodes.input_nodes(node):
                if arg in inside or arg in split.inputs or (arg.op == "get_attr" and not _nodes.tensors(arg)):
                    continue
                split.inputs.append(arg)
        if split.plan is not None:
            split.inputs = list(split.plan.inputs)  # the slice bodies' order (constants live inside them)
        for arg in split.inputs:
            source = owner[arg].device if arg in owner else assignment[arg].device if arg in assignment else None
            if source is not None and _nodes.tensors(arg) and source != split.device:
                split.copies[arg] = source
        split.outputs = [node for node in split.nodes if any(owner.get(user) is not split for user in node.users)]


def _example(node: torch.fx.Node, split: Split, produced_by_dfs: set[torch.fx.Node]) -> object:
    value = _nodes.value(node)
    if not isinstance(value, torch.Tensor):
        return value
    if node in split.copies or node in produced_by_dfs:
        value = runtime_layout(value)
    if value.device != split.device:
        value = value.to(split.device)
    return value


def partition(
    graph_module: torch.fx.GraphModule,
    assignment: dict[torch.fx.Node, Assignment],
    plans: Sequence[SliceSchedule],
    ledger: HintLedger,
) -> list[Split]:
    """The graph's splits in execution order, each with its own GraphModule (DFS: its slice bodies)."""
    splits = _runs(graph_module.graph, assignment, plans, ledger)
    _connect(splits, assignment)
    produced_by_dfs = {node for split in splits if split.plan for node in split.outputs}
    for split in splits:
        if split.plan is not None:
            continue
        moved = any(_nodes.device_of(node) not in (None, split.device) for node in split.nodes)
        examples = [_example(node, split, produced_by_dfs) for node in split.inputs]
        split.graph_module = extract(
            graph_module, split.nodes, split.inputs, split.outputs, examples, device=split.device if moved else None
        )
    return splits
