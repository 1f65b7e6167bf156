"""The arena layout of one graph: which results arena execution writes into one buffer
per device, at which offsets, and which are allocated outside it, and why.

Arena execution (``torch.compile(..., backend="tightfit", options={"memory": "arena"})``)
and the planner (``plan_memory(..., runtime="arena")``) both call :func:`arena_layout`,
so what runs is what was predicted. The lifetimes and offsets are the planner's own
(:func:`~tightfit.graph.alloc.program.graph_plans` in the written order,
:func:`~tightfit.graph.alloc.arena.place_arena`, verified). A storage goes in the arena
when the op that creates it has an ``out=`` variant with a kernel for the device, runs
in a whole split (not a DFS one) on the device its result is on, and the storage does
not escape the graph (a graph output, such as an activation the forward saves for the
backward, outlives the program call, and would keep the whole arena alive with it). Views and in-place results alias
their base as planned. Everything else is allocated as usual and listed in ``outside``.

A device's arena is allocated right before the first op that writes into it and freed
when the last tensor placed in it dies (the run drops its own reference after the last
op that writes into it; views keep it alive to their planned end):
:meth:`ArenaLayout.timeline` is the plan of that run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx

from tightfit.graph import _nodes
from tightfit.graph.alloc.arena import Arena, place_arena
from tightfit.graph.alloc.liveness import Buffer, Timeline, storages_of
from tightfit.graph.alloc.program import ScheduledGraph, graph_plans
from tightfit.graph.alloc.verify import verify_arena
from tightfit.graph.out_variants import OutVariant, out_variant
from tightfit.graph.partition import Split

__all__ = ["ARENA_ALIGNMENT", "ArenaLayout", "Outside", "arena_layout"]

#: Alignment of every offset in an execution arena, in bytes (a multiple of every dtype's size).
ARENA_ALIGNMENT = 64


@dataclass(frozen=True)
class Outside:
    """A storage allocated outside the arena: what made it, its size, and why it is not in the arena."""

    graph: str
    name: str
    op: str
    device: str
    nbytes: int
    reason: str


@dataclass(frozen=True)
class ArenaLayout:
    """One graph's arenas and where each result goes.

    ``arenas``: per device, the verified placement (``Arena.size`` bytes are allocated);
    ``slots``: per node name, the arena offset of each tensor result (None: allocated as
    usual); ``out_ops``: per node name, the out variant it runs with; ``outside``: the
    storages allocated as usual; ``closes``: per device, the last node that writes into
    its arena; ``lifetimes``: per device, the steps at which its arena is allocated and
    at which the last tensor in it dies.
    """

    name: str
    alignment: int
    arenas: dict[str, Arena]
    slots: dict[str, tuple[int | None, ...]]
    out_ops: dict[str, OutVariant]
    outside: tuple[Outside, ...]
    closes: dict[str, str]
    lifetimes: dict[str, tuple[int, int]]

    def arena_bytes(self, device: str) -> int:
        """The size of ``device``'s arena (0: none)."""
        arena = self.arenas.get(device)
        return arena.size if arena else 0

    def timeline(self, timeline: Timeline) -> Timeline:
        """``timeline`` (the graph's plan in the written order) as arena execution runs it:
        the arena's buffers replaced by one buffer per device, alive from the step its
        arena is allocated to the step its last tenant dies."""
        placed = {(buffer.device, buffer.name) for arena in self.arenas.values() for buffer in arena.buffers}
        buffers = [buffer for buffer in timeline.buffers if (buffer.device, buffer.name) not in placed]
        for device, arena in self.arenas.items():
            start, end = self.lifetimes[device]
            buffers.append(
                Buffer(f"arena of the {self.name} graph", device, arena.size, start, end, "arena", self.name)
            )
        return replace(timeline, buffers=buffers)


def _reason(node: torch.fx.Node, split: Split | None, device: str, escapes: bool) -> tuple[OutVariant | None, str]:
    if split is None or split.plan is not None:
        return None, "in a DFS split"
    found, why = out_variant(node.target, split.device.type)
    if found is None:
        return None, why
    if str(split.device) != device:
        return None, f"moved from {device} to {split.device}"
    if escapes:
        return found, "a graph output"
    return found, ""


def arena_layout(
    graph_module: torch.fx.GraphModule,
    splits: Sequence[Split],
    *,
    name: str = "graph",
    alignment: int = ARENA_ALIGNMENT,
    plan: ScheduledGraph | None = None,
) -> ArenaLayout:
    """The arena layout of ``graph_module`` run split by split in the written order.

    ``plan``: the graph's plan in the written order with these splits, if made already.
    """
    if plan is None:
        plan = graph_plans(graph_module, splits=splits, orders=("written",), name=name, alignment=alignment)["written"]
    found = storages_of(graph_module.graph)
    owner = {node: split for split in splits for node in split.nodes}
    by_name = {buffer.name: buffer for buffer in plan.timeline.buffers if buffer.kind in ("activation", "output")}
    producer: dict[int, torch.fx.Node] = {}
    for node in plan.nodes:
        for sid in found.refs.get(node, ()):
            if found.kind[sid] == "new":
                producer.setdefault(sid, node)
    chosen: dict[str, list[Buffer]] = {}
    wanted: dict[torch.fx.Node, list[Buffer | None]] = {}
    variants: dict[torch.fx.Node, OutVariant] = {}
    outside: list[Outside] = []
    for node in plan.nodes:
        sids = found.refs.get(node, ())
        fresh = [sid for sid in sids if producer.get(sid) is node]
        if not fresh:
            continue  # a view, an in-place result or a getitem: it aliases its base
        fakes = _nodes.tensors(node)
        whole = len(fresh) == len(sids) == len(fakes) and all(_nodes.is_dense(fake) for fake in fakes)
        leaves: list[Buffer | None] = []
        for sid in sids:
            buffer = by_name.get(found.names[sid])
            if buffer is None:  # inside a DFS split's slices: it never exists whole
                leaves.append(None)
                continue
            variant, why = _reason(node, owner.get(node), buffer.device, buffer.kind == "output")
            if variant is not None and not whole:
                variant, why = None, "results that share a storage or are not dense"
            if variant is not None:
                variants[node] = variant
            if why:
                outside.append(Outside(name, buffer.name, _nodes.op_name(node), buffer.device, buffer.nbytes, why))
                leaves.append(None)
            else:
                chosen.setdefault(buffer.device, []).append(buffer)
                leaves.append(buffer)
        if any(leaf is not None for leaf in leaves):
            wanted[node] = leaves
    for buffer in plan.timeline.buffers:
        if buffer.kind in ("copy", "scratch"):
            outside.append(Outside(name, buffer.name, buffer.kind, buffer.device, buffer.nbytes, buffer.kind))
    arenas = {device: place_arena(device, buffers, alignment) for device, buffers in chosen.items()}
    for arena in arenas.values():
        verify_arena(arena)
    offsets = {
        (arena.device, buffer.name): offset
        for arena in arenas.values()
        for buffer, offset in zip(arena.buffers, arena.offsets)
    }
    slots = {
        node.name: tuple(None if leaf is None else offsets[(leaf.device, leaf.name)] for leaf in leaves)
        for node, leaves in wanted.items()
    }
    step = {node: index for index, node in enumerate(plan.nodes)}
    closes: dict[str, str] = {}
    lifetimes: dict[str, tuple[int, int]] = {}
    for device, arena in arenas.items():
        writers = sorted(
            (step[node], node.name)
            for node, leaves in wanted.items()
            if any(leaf is not None and leaf.device == device for leaf in leaves)
        )
        closes[device] = writers[-1][1]
        lifetimes[device] = (writers[0][0], max(buffer.end for buffer in arena.buffers))
    return ArenaLayout(
        name,
        alignment,
        arenas,
        slots,
        {node.name: variants[node] for node in wanted},
        tuple(outside),
        closes,
        lifetimes,
    )
