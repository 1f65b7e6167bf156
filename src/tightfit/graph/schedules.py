"""Schedules: a region hinted ``schedule="dfs", slices=N`` runs as N sequential slices.

BFS (the default) runs a region whole: every intermediate of the region is alive at
once, for all of its parallel slices (attention: the scores of every head). DFS runs
the region once per slice of its parallel dimension, so only one slice's
intermediates are alive at a time; the outputs are written into one preallocated
result. This pass decides which regions can be rewritten:

- it groups the nodes of a DFS region placed on one backend that honors ``schedule``;
- it proves the rewrite valid with :mod:`tightfit.graph.slicing` (no op reduces or
  mixes across the sliced dimension), on ``slice_dim`` or, for "auto", on the first
  dimension that works; otherwise the hint is ignored with the reason logged (an error
  in strict mode);
- it moves nodes that do not belong to the region out from between the region's
  nodes, so that the sliced part is one contiguous run (a split of its own), and nodes
  of the region that do not depend on the sliced data run once, before it.

The result is one :class:`SliceSchedule` per rewritten region; partition and execution
turn it into a loop over slices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx

from tightfit.graph import _nodes
from tightfit.graph._extract import extract
from tightfit.graph.assign import Assignment
from tightfit.graph.honor import HintLedger
from tightfit.graph.slicing import Invalid, Proof, Rewrite, Sliced, State, prove, take
from tightfit.hints.read import node_hints, owning_region
from tightfit.hints.schema import keys_honored_by

__all__ = ["SliceSchedule", "plan_schedules", "slice_bounds"]

#: The keys this pass honors (the hint table says which): a region that writes one owns
#: the schedule of its nodes.
_SCHEDULE_KEYS = keys_honored_by("schedules")


@dataclass
class SliceSchedule:
    """One region rewritten to run slice by slice."""

    region: int
    nodes: list[torch.fx.Node]  # the sliced nodes, contiguous in the graph
    dim: int  # the sliced dimension of the region's highest-rank inputs
    extent: int  # elements along it
    slices: int
    states: dict[torch.fx.Node, State]
    rewrites: dict[torch.fx.Node, Rewrite]
    inputs: list[torch.fx.Node] = field(default_factory=list)  # what the sliced run reads
    outputs: list[torch.fx.Node] = field(default_factory=list)  # what it gives to later nodes
    bodies: dict[int, torch.fx.GraphModule] = field(default_factory=dict)  # one slice's graph per length

    def state(self, node: torch.fx.Node) -> State:
        """How an input or output of the sliced run is sliced (None: whole)."""
        return self.states.get(node)

    def bounds(self) -> list[tuple[int, int]]:
        """(start, length) of each slice along the sliced axis."""
        return slice_bounds(self.extent, self.slices)

    def describe(self) -> str:
        return f"dfs: {self.slices} slices of dim {self.dim} ({self.extent} elements), region {self.region}"


def slice_bounds(extent: int, slices: int) -> list[tuple[int, int]]:
    """Balanced slices: lengths differ by at most one (at most two distinct lengths)."""
    base, extra = divmod(extent, slices)
    bounds, start = [], 0
    for index in range(slices):
        length = base + (1 if index < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


def schedule_region(node: torch.fx.Node) -> int | None:
    """The innermost region that wrote a schedule key for this node (its schedule's owner)."""
    return owning_region(node, _SCHEDULE_KEYS)


def _groups(
    graph: torch.fx.Graph, assignment: dict[torch.fx.Node, Assignment], ledger: HintLedger
) -> list[list[torch.fx.Node]]:
    groups: dict[tuple[object, ...], list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node_hints(node).get("schedule") != "dfs" or node not in assignment:
            continue
        where = assignment[node]
        if "schedule" not in ledger.capabilities(where.backend).hints:
            continue  # reported by the ledger as not honored
        key = (schedule_region(node), where.backend.name, where.device)
        group = groups.setdefault(key, [])
        group.append(node)
        group.extend(user for user in node.users if _nodes.is_getitem(user) and user not in group)
    order = {node: index for index, node in enumerate(graph.nodes)}
    return [sorted(set(group), key=order.__getitem__) for group in groups.values()]


def _inputs(nodes: Sequence[torch.fx.Node], *, tensors_only: bool) -> list[torch.fx.Node]:
    inside, found = set(nodes), []
    for node in nodes:
        for arg in _nodes.input_nodes(node):
            if arg in inside or arg in found or arg.op == "get_attr":
                continue
            if not tensors_only or isinstance(_nodes.value(arg), torch.Tensor):
                found.append(arg)
    return found


def _static(nodes: Sequence[torch.fx.Node]) -> bool:
    for node in nodes:
        for tensor in _nodes.tensors(node):
            if not all(isinstance(size, int) for size in tensor.shape):
                return False
    return True


def _prove_any(nodes: list[torch.fx.Node], inputs: list[torch.fx.Node], slice_dim: object) -> tuple[int, Proof]:
    rank = max(len(_nodes.value(arg).shape) for arg in inputs)
    dims = [slice_dim] if isinstance(slice_dim, int) else list(range(rank))
    reasons = []
    for dim in dims:
        try:
            return dim, prove(nodes, inputs, dim)
        except Invalid as error:
            reasons.append(f"dim {dim}: {error}")
    raise Invalid("; ".join(reasons))


def _make_contiguous(graph: torch.fx.Graph, sliced: list[torch.fx.Node]) -> None:
    """Move the nodes between the sliced ones out of the way; raise Invalid if impossible."""
    order = list(graph.nodes)
    first, last = order.index(sliced[0]), order.index(sliced[-1])
    inside = set(sliced)
    before, after, downstream = [], [], set()
    for node in order[first : last + 1]:
        if node in inside:
            continue
        if any(arg in inside or arg in downstream for arg in _nodes.input_nodes(node)):
            downstream.add(node)
            after.append(node)
        else:
            before.append(node)
    for node in sliced:
        blocker = next((arg for arg in _nodes.input_nodes(node) if arg in downstream), None)
        if blocker is not None:
            raise Invalid(
                f"the region is not contiguous: {blocker.name} uses the region's values and feeds {node.name}"
            )
    for node in before + after:
        if node_hints(node).get("order") == "as_written":
            raise Invalid(
                f"making the region contiguous would move {node.name}, which is in an order='as_written' region"
            )
    for node in before:
        sliced[0].prepend(node)
    anchor = sliced[-1]
    for node in after:
        anchor.append(node)
        anchor = node


def _plan_group(
    graph_module: torch.fx.GraphModule,
    group: list[torch.fx.Node],
    assignment: dict[torch.fx.Node, Assignment],
    ledger: HintLedger,
) -> SliceSchedule | None:
    hints = node_hints(group[0])
    slices, slice_dim = hints.get("slices"), hints.get("slice_dim", "auto")
    what = f"schedule='dfs' slices={slices}"
    if slices is None:
        ledger.not_applied(group[0], "schedule='dfs'", "it needs slices=N (an int >= 2)")
        return None
    if slices == 1:
        return None
    inputs = _inputs(group, tensors_only=True)
    if not inputs:
        ledger.not_applied(group[0], what, "the region reads no tensor from outside, so there is nothing to slice")
        return None
    if not _static(group + inputs):
        ledger.not_applied(group[0], what, "the graph has dynamic shapes; DFS slicing needs static ones")
        return None
    try:
        dim, proof = _prove_any(group, inputs, slice_dim)
        sliced = [node for node in group if _is_sliced(proof.states[node])]
        if not sliced:
            raise Invalid("nothing in the region depends on the sliced inputs")
        for node in sliced:
            if isinstance(proof.states[node], tuple) and any(user not in sliced for user in node.users):
                raise Invalid(f"{node.name} returns several values that leave the region unsplit")
        _make_contiguous(graph_module.graph, sliced)
        plan = SliceSchedule(
            schedule_region(group[0]) or 0,
            sliced,
            dim,
            proof.extent,
            min(slices, proof.extent),
            proof.states,
            proof.rewrites,
        )
        _build_bodies(graph_module, plan, assignment[group[0]].device)
    except Invalid as error:
        ledger.not_applied(group[0], what, str(error))
        return None
    return plan


def _expected_shapes(value: object, state: State, length: int) -> list[tuple[int, ...]]:
    values = value if isinstance(value, (tuple, list)) else (value,)
    states = state if isinstance(state, tuple) else (state,) * len(values)
    shapes = []
    for part, part_state in zip(values, states):
        if isinstance(part, torch.Tensor):
            shape = list(part.shape)
            if isinstance(part_state, Sliced):
                shape[part_state.dim] = part_state.size(length)
            shapes.append(tuple(shape))
    return shapes


def _on(value: object, device: torch.device) -> object:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value


def _build_bodies(graph_module: torch.fx.GraphModule, plan: SliceSchedule, device: torch.device) -> None:
    """One slice's graph per distinct slice length on ``device``, shape-checked against the proof."""
    inside = set(plan.nodes)
    plan.inputs = _inputs(plan.nodes, tensors_only=False)
    plan.outputs = [node for node in plan.nodes if any(user not in inside for user in node.users)]
    for node in plan.outputs:
        if not isinstance(plan.state(node), Sliced):
            raise Invalid(f"{node.name} leaves the region whole, not sliced")
    for start, length in plan.bounds():
        if length in plan.bodies:
            continue
        examples = [
            _on(take(_nodes.value(arg), plan.state(arg), plan.extent, start, length), device) for arg in plan.inputs
        ]
        moved = any(_nodes.device_of(node) not in (None, device) for node in plan.nodes)
        try:
            body = extract(
                graph_module,
                plan.nodes,
                plan.inputs,
                plan.outputs,
                examples,
                rewrites=plan.rewrites,
                length=length,
                device=device if moved else None,
            )
        except Exception as error:  # a rule's rewrite that the ops reject: refuse, never guess
            raise Invalid(f"the sliced graph does not trace: {type(error).__name__}: {error}") from None
        copies = {
            node.name: new for node, new in zip(plan.nodes, (n for n in body.graph.nodes if n.op == "call_function"))
        }
        for node in plan.nodes:
            got = [tuple(t.shape) for t in _nodes.tensors(copies[node.name])]
            if got != _expected_shapes(_nodes.value(node), plan.state(node), length):
                raise Invalid(
                    f"{node.name}: a slice of length {length} gives shapes {got}, the proof expected "
                    f"{_expected_shapes(_nodes.value(node), plan.state(node), length)}"
                )
        plan.bodies[length] = body


def _is_sliced(state: State) -> bool:
    if isinstance(state, tuple):
        return any(isinstance(part, Sliced) for part in state)
    return isinstance(state, Sliced)


def plan_schedules(
    graph_module: torch.fx.GraphModule, assignment: dict[torch.fx.Node, Assignment], ledger: HintLedger
) -> list[SliceSchedule]:
    """Prove and prepare every DFS region of the graph (reordering nodes where needed)."""
    graph = graph_module.graph
    plans = []
    for group in _groups(graph, assignment, ledger):
        plan = _plan_group(graph_module, group, assignment, ledger)
        if plan is not None:
            plans.append(plan)
    graph.lint()
    return plans
