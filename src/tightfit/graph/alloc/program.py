"""Planning one aten graph the way the compile backend runs it: its splits in order.

On top of the op-by-op lifetimes of :mod:`~tightfit.graph.alloc.liveness`, a
:class:`~tightfit.graph.partition.Split` changes three things, all modelled here:

- a split returns all its outputs at its end; it frees its inputs and intermediates op
  by op after their last use (``Program`` hands a split the only references to the
  values no later split reads), except a DFS split, which holds its inputs until it
  ends (every slice reads them);
- an input that comes from another device is copied at the split's start and kept
  until its last use there (a ``copy`` buffer on the split's device);
- a DFS split preallocates its results at its start; its slices' intermediates live in
  a workspace as large as one slice body's own arena (a ``scratch`` buffer), and none
  of the region's other intermediates exist whole.

Reorderable runs (whole splits, not hinted ``order="as_written"``) may take any of the
candidate orders of :mod:`~tightfit.graph.alloc.order`; the order whose timeline has
the lowest total lower bound is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.fx

from tightfit._deprecation import renamed
from tightfit.graph import _nodes
from tightfit.graph.alloc.arena import Arena, place_arena
from tightfit.graph.alloc.liveness import Buffer, Storages, Timeline, align, graph_timeline, lifetimes, storages_of
from tightfit.graph.alloc.order import TOPOLOGICAL_ORDERS, candidate_orders, canonical_order, choose_order
from tightfit.graph.partition import Split

__all__ = ["ScheduledGraph", "graph_plans", "join_training", "plan_arenas", "plan_graph", "total_bound"]


@dataclass
class _Run:
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = field(default_factory=list)
    outputs: list[torch.fx.Node] = field(default_factory=list)
    copies: dict[torch.fx.Node, torch.device] = field(default_factory=dict)
    device: str = ""
    reorderable: bool = True
    split: Split | None = None


@dataclass
class ScheduledGraph:
    """One graph's timeline in the chosen order, and what joining graphs needs (``GraphPlan``
    before: "plan" now names the fit and memory plans only; the old name works for one release).

    ``order``: the chosen candidate; ``order_peaks``: each candidate's total lower bound
    (bytes, summed over devices); ``outputs``: for each output position, the names of
    the arena buffers it refers to; ``placeholders``: (name, device, bytes, kind) of
    each input; ``last_use``: the last step reading each placeholder (-1: none).
    """

    name: str
    timeline: Timeline
    order: str
    order_peaks: dict[str, int]
    nodes: list[torch.fx.Node]
    outputs: list[tuple[str, ...]]
    placeholders: list[tuple[str, str, int, str]]
    last_use: dict[str, int]


def _runs(graph: torch.fx.Graph, splits: Sequence[Split] | None) -> list[_Run]:
    if splits is None:
        return [_Run([node for node in graph.nodes if node.op == "call_function"])]
    runs = []
    for split in splits:
        runs.append(
            _Run(
                list(split.nodes),
                list(split.inputs),
                list(split.outputs),
                dict(split.copies),
                str(split.device),
                split.plan is None and not split.as_written,
                split,
            )
        )
    return runs


def _last_read(node: torch.fx.Node, order: Sequence[torch.fx.Node], first: int, found: Storages) -> int:
    """The last step of a run (starting at step ``first``) that reads ``node``'s storage, itself or through a view."""
    sids = set(found.refs.get(node, ()))
    reads = [
        first + index
        for index, op in enumerate(order)
        if any(sids & set(found.refs.get(arg, ())) for arg in _nodes.input_nodes(op))
    ]
    return max(reads, default=first)


def _holds_inputs(run: _Run) -> bool:
    """A DFS split reads its inputs in every slice: it holds them to its end."""
    return run.split is not None and run.split.plan is not None


def _scratch_bytes(split: Split, alignment: int) -> int:
    """The workspace of one slice of a DFS split: the largest slice body's own arena."""
    largest = 0
    for body in split.plan.bodies.values():
        timeline = graph_timeline(body, name="slice")
        size = sum(place_arena(device, timeline.device_buffers(device), alignment).size for device in timeline.devices)
        placeholders = [node for node in body.graph.nodes if node.op == "placeholder"]
        for node, whole in zip(placeholders, split.plan.inputs):
            state = split.plan.state(whole)
            if getattr(state, "outer", 1) != 1:  # a slice of a merged axis is gathered into a copy
                size += sum(align(_nodes.nbytes(t), alignment) for t in _nodes.tensors(node))
        largest = max(largest, size)
    return largest


def _timeline(
    graph: torch.fx.Graph,
    runs: Sequence[_Run],
    orders: Sequence[list[torch.fx.Node]],
    found: Storages,
    name: str,
    alignment: int,
) -> tuple[Timeline, list[torch.fx.Node]]:
    ops = [node for order in orders for node in order]
    bounds, holds, position = [], [], 0
    for run, order in zip(runs, orders):
        first, last = position, position + len(order) - 1
        bounds.append((first, last))
        held = run.inputs + run.outputs if _holds_inputs(run) else run.outputs
        holds.extend((node, last) for node in held)
        position += len(order)
    spans = lifetimes(graph, ops, found, holds)
    extra: list[Buffer] = []
    for run, order, (first, last) in zip(runs, orders, bounds):
        if run.split is not None and run.split.plan is not None:
            kept = {sid for node in run.outputs for sid in found.refs.get(node, ())}
            for node in run.nodes:
                for sid in found.refs.get(node, ()):
                    if sid in spans and sid not in kept and spans[sid][0] >= first:
                        del spans[sid]
                    elif sid in spans and sid in kept:
                        spans[sid] = (first, *spans[sid][1:])
            extra.append(
                Buffer(
                    f"split {run.split.index} slice workspace",
                    run.device,
                    _scratch_bytes(run.split, alignment),
                    first,
                    last,
                    "scratch",
                    name,
                )
            )
        for node, source in run.copies.items():
            end = last if _holds_inputs(run) else _last_read(node, order, first, found)
            for tensor in _nodes.tensors(node):
                extra.append(
                    Buffer(
                        f"{node.name} copied from {source}", run.device, _nodes.nbytes(tensor), first, end, "copy", name
                    )
                )
    timeline = Timeline(
        steps=[node.name for node in ops],
        step_graphs=[name] * len(ops),
        weights=found.bytes_of("weight"),
        inputs=found.bytes_of("input"),
    )
    timeline.buffers = [
        Buffer(found.names[sid], found.device[sid], found.nbytes[sid], start, end, kind, name)
        for sid, (start, end, kind) in spans.items()
    ] + extra
    return timeline, ops


def graph_plans(
    graph_module: torch.fx.GraphModule,
    *,
    splits: Sequence[Split] | None = None,
    weights: Iterable[torch.fx.Node] = (),
    orders: Sequence[str] = TOPOLOGICAL_ORDERS,
    released: Iterable[torch.fx.Node] = (),
    name: str = "graph",
    alignment: int = 64,
) -> dict[str, ScheduledGraph]:
    """One plan of the graph per candidate order in ``orders`` (see :func:`plan_graph`).

    ``released``: placeholders that hold values a previous graph made and hands over
    (the forward's saved activations, read by the backward): an order that frees them
    sooner is better, and least-peak-first counts them.
    """
    unknown = [order for order in orders if order not in TOPOLOGICAL_ORDERS]
    if unknown or not orders:
        raise ValueError(
            f"orders={list(orders)!r} is not accepted; accepted: a non-empty list of {', '.join(TOPOLOGICAL_ORDERS)}"
        )
    graph = graph_module.graph
    found = storages_of(graph, weights)
    runs = _runs(graph, splits)
    escaping: set[int] = set()
    for node in graph.nodes:
        if node.op == "output":
            torch.fx.node.map_arg(node.args, lambda arg: escaping.update(found.refs.get(arg, ())))
    handed = {sid for node in released for sid in found.refs.get(node, ())}
    candidates: list[dict[str, list[torch.fx.Node]]] = []
    for run in runs:
        if run.reorderable and tuple(orders) != ("written",):
            local = escaping | {sid for node in run.outputs for sid in found.refs.get(node, ())}
            candidates.append(candidate_orders(run.nodes, found, escaping=local, released=handed))
        else:
            candidates.append({order: run.nodes for order in TOPOLOGICAL_ORDERS})
    outputs, placeholders = _output_buffers(graph, found), _placeholders(graph, found)
    plans = {}
    for order in orders:
        timeline, ops = _timeline(graph, runs, [c[order] for c in candidates], found, name, alignment)
        plans[order] = ScheduledGraph(
            name, timeline, order, {}, ops, outputs, placeholders, _last_use(graph, ops, runs)
        )
    peaks = {order: total_bound(plan.timeline, alignment) for order, plan in plans.items()}
    for plan in plans.values():
        plan.order_peaks = dict(peaks)
    return plans


def total_bound(timeline: Timeline, alignment: int) -> int:
    """The lower bounds of every device of ``timeline``, summed: what candidate orders are compared by."""
    return sum(timeline.lower_bound(device, alignment) for device in timeline.devices)


def plan_graph(
    graph_module: torch.fx.GraphModule,
    *,
    splits: Sequence[Split] | None = None,
    weights: Iterable[torch.fx.Node] = (),
    order: str = "best",
    name: str = "graph",
    alignment: int = 64,
) -> ScheduledGraph:
    """The timeline of one graph run split by split (``splits`` None: as one run, op by op).

    ``weights``: placeholders that are weights (counted apart from inputs). ``order``:
    "best" (the candidate with the lowest predicted peak; the written order wins ties)
    or one of :data:`~tightfit.graph.alloc.order.TOPOLOGICAL_ORDERS` ("written": as traced).
    """
    order = canonical_order(order)
    plans = graph_plans(
        graph_module,
        splits=splits,
        weights=weights,
        orders=TOPOLOGICAL_ORDERS if order == "best" else (order,),
        name=name,
        alignment=alignment,
    )
    return plans[choose_order(next(iter(plans.values())).order_peaks)]


def _output_buffers(graph: torch.fx.Graph, found: Storages) -> list[tuple[str, ...]]:
    output = next(node for node in graph.nodes if node.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    named = []
    for value in values:
        sids: list[int] = []
        torch.fx.node.map_arg(value, lambda arg: sids.extend(found.refs.get(arg, ())))  # noqa: B023 (called at once)
        named.append(tuple(found.names[sid] for sid in sids if found.kind[sid] == "new"))
    return named


def _placeholders(graph: torch.fx.Graph, found: Storages) -> list[tuple[str, str, int, str]]:
    rows = []
    for node in graph.nodes:
        if node.op == "placeholder":
            sids = found.refs.get(node, ())
            rows.append(
                (
                    node.name,
                    found.device[sids[0]] if sids else "",
                    sum(found.nbytes[s] for s in sids),
                    found.kind[sids[0]] if sids else "input",
                )
            )
    return rows


def _last_use(graph: torch.fx.Graph, ops: Sequence[torch.fx.Node], runs: Sequence[_Run]) -> dict[str, int]:
    step = {node: index for index, node in enumerate(ops)}
    last = {node.name: -1 for node in graph.nodes if node.op == "placeholder"}
    run_end = {}
    position = 0
    for run in runs:
        position += len(run.nodes)
        if _holds_inputs(run):
            for node in run.inputs:
                run_end[node] = position - 1
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        readers = [step[user] for user in node.users if user in step]
        for view in _views_of(node):
            readers.extend(step[user] for user in view.users if user in step)
        readers.append(run_end.get(node, -1))
        last[node.name] = max(readers)
    return last


def _views_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes that alias ``node``'s storage (views of views included)."""
    key = {t.untyped_storage()._cdata for t in _nodes.tensors(node)}
    found, pending = [], list(node.users)
    while pending:
        user = pending.pop()
        if user.op == "call_function" and any(t.untyped_storage()._cdata in key for t in _nodes.tensors(user)):
            found.append(user)
            pending.extend(user.users)
    return found


def plan_arenas(timeline: Timeline, alignment: int = 64) -> dict[str, Arena]:
    """One arena per device for the timeline's buffers (the smaller of the placements)."""
    return {device: place_arena(device, timeline.device_buffers(device), alignment) for device in timeline.devices}


def join_training(
    forward: ScheduledGraph,
    backward: ScheduledGraph,
    saved: Sequence[tuple[int, int]],
    kept: Iterable[int] | None = None,
) -> Timeline:
    """One timeline for a training step: the forward's steps, then the backward's.

    ``saved``: (forward output position, backward placeholder position) of each value the
    forward saves for the backward; such a value lives until the backward's last use of
    it. ``kept``: the forward's output positions the caller keeps to the end of the step
    (the loss; None: every output); its other outputs die when the forward returns. The
    backward's other inputs (the gradients of the outputs) are inputs.
    """
    forward_steps = len(forward.timeline.steps)
    last = forward_steps + len(backward.timeline.steps) - 1
    saved_at = dict(saved)
    kept = set(range(len(forward.outputs)) if kept is None else kept)
    ends: dict[str, int] = {}
    returned: set[str] = set()
    for position, names in enumerate(forward.outputs):
        if position in saved_at:
            placeholder = backward.placeholders[saved_at[position]][0]
            end = forward_steps + backward.last_use[placeholder]
        elif position in kept:
            end = last
            returned.update(names)
        else:
            end = forward_steps - 1
        for name in names:
            ends[name] = max(ends.get(name, forward_steps - 1), end)
    buffers = []
    for buffer in forward.timeline.buffers:
        if buffer.name in ends:
            kind = "output" if buffer.name in returned else "activation"
            buffer = replace(buffer, end=max(ends[buffer.name], forward_steps - 1), kind=kind)
        buffers.append(buffer)
    buffers += [replace(b, start=b.start + forward_steps, end=b.end + forward_steps) for b in backward.timeline.buffers]
    inputs = dict(forward.timeline.inputs)
    taken = set(saved_at.values())
    for position, (_, device, nbytes, kind) in enumerate(backward.placeholders):
        if position not in taken and kind == "input" and device:
            inputs[device] = inputs.get(device, 0) + nbytes
    return Timeline(
        steps=forward.timeline.steps + backward.timeline.steps,
        step_graphs=forward.timeline.step_graphs + backward.timeline.step_graphs,
        buffers=buffers,
        weights=dict(forward.timeline.weights),
        inputs=inputs,
    )


__getattr__ = renamed(__name__, GraphPlan=("ScheduledGraph", lambda: ScheduledGraph))
