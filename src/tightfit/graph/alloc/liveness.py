"""Liveness: which storage each tensor of an FX graph lives in, and for how long.

Aliasing comes from the fake tensors the tracer left on the nodes (``node.meta["val"]``):
a view, an in-place result or a ``getitem`` of a multi-output op shares the storage of
what it aliases, exactly as it would at run time. A storage is one buffer; it is born
at the first step whose node produces it and lives to the last step that reads any
tensor in it. Graph outputs live to the end. Inputs and weights (placeholders and
``get_attr`` constants) are counted apart: they are not placed in an arena.

Steps are the graph's ``call_function`` nodes in execution order (the written order
unless another valid order is given). Buffer lifetimes are inclusive step ranges.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from tightfit.graph import _nodes

__all__ = ["Buffer", "Timeline", "Storages", "align", "check_order", "graph_timeline", "lifetimes", "storages_of"]

#: What a buffer holds: an intermediate, a graph output (lives to the end), a DFS
#: split's per-slice workspace, a copy of a split's input from another device, or a
#: whole execution arena (``runtime="arena"``: see :mod:`~tightfit.graph.alloc.layout`).
BUFFER_KINDS = ("activation", "output", "scratch", "copy", "arena")


def align(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


@dataclass(frozen=True)
class Buffer:
    """One storage placed in a device's arena, alive over steps ``start..end`` (inclusive)."""

    name: str
    device: str
    nbytes: int
    start: int
    end: int
    kind: str = "activation"
    graph: str = ""

    def overlaps_in_time(self, other: Buffer) -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass
class Timeline:
    """Steps in execution order and the buffers alive across them, for every device.

    ``weights`` and ``inputs`` map a device to the bytes of distinct weight and input
    storages there (not in the arena). ``step_graphs`` names the graph each step
    belongs to (a training plan runs the forward then the backward).
    """

    steps: list[str] = field(default_factory=list)
    step_graphs: list[str] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    weights: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, int] = field(default_factory=dict)

    @property
    def devices(self) -> list[str]:
        found = {buffer.device for buffer in self.buffers} | set(self.weights) | set(self.inputs)
        return sorted(found)

    def device_buffers(self, device: str) -> list[Buffer]:
        return [buffer for buffer in self.buffers if buffer.device == device]

    def live_bytes(self, device: str, alignment: int = 1) -> list[int]:
        """Bytes of the buffers alive at each step on ``device`` (sizes rounded up to ``alignment``)."""
        delta = [0] * (len(self.steps) + 1)
        for buffer in self.device_buffers(device):
            size = align(buffer.nbytes, alignment)
            delta[buffer.start] += size
            delta[buffer.end + 1] -= size
        live, running = [], 0
        for change in delta[:-1]:
            running += change
            live.append(running)
        return live

    def lower_bound(self, device: str, alignment: int = 1) -> int:
        """The most bytes alive at once on ``device``: no arena can be smaller."""
        return max(self.live_bytes(device, alignment), default=0)

    def peak_step(self, device: str, alignment: int = 1) -> int | None:
        """The first step at which the live bytes on ``device`` are highest (None: no steps)."""
        live = self.live_bytes(device, alignment)
        return live.index(max(live)) if live else None

    def live_at(self, device: str, step: int) -> list[Buffer]:
        """Buffers alive on ``device`` at ``step``, largest first."""
        alive = [b for b in self.device_buffers(device) if b.start <= step <= b.end]
        return sorted(alive, key=lambda b: (-b.nbytes, b.start, b.name))


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (TypeError, RuntimeError) as error:  # a symbolic size with no hint
        raise ValueError(
            f"a tensor of shape {tuple(tensor.shape)} has a dynamic size; memory planning needs static shapes"
        ) from error


def _leaves(node: torch.fx.Node) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(_nodes.value(node))[0] if isinstance(leaf, torch.Tensor)]


@dataclass
class Storages:
    """The storages of one graph: which node refers to which, and what each one is."""

    refs: dict[torch.fx.Node, tuple[int, ...]]  # storage ids of a node's tensor leaves
    nbytes: dict[int, int]
    device: dict[int, str]
    names: dict[int, str]
    kind: dict[int, str]  # "input", "weight" or "new"

    def bytes_of(self, kind: str) -> dict[str, int]:
        """Bytes of distinct storages of one kind, per device."""
        totals: dict[str, int] = {}
        for sid, what in self.kind.items():
            if what == kind:
                totals[self.device[sid]] = totals.get(self.device[sid], 0) + self.nbytes[sid]
        return totals


def storages_of(graph: torch.fx.Graph, weights: Iterable[torch.fx.Node] = ()) -> Storages:
    """Storage ids of every node's tensors; placeholders in ``weights`` and ``get_attr`` nodes are weights."""
    weights = set(weights)
    keys: dict[int, int] = {}
    found = Storages({}, {}, {}, {}, {})
    for node in graph.nodes:
        if node.op == "output":
            continue
        ids = []
        for index, tensor in enumerate(_leaves(node)):
            key = _storage_key(tensor)
            if key not in keys:
                sid = keys[key] = len(keys)
                found.nbytes[sid] = _storage_bytes(tensor)
                found.device[sid] = str(tensor.device)
                found.names[sid] = node.name if len(_leaves(node)) == 1 else f"{node.name}[{index}]"
                if node.op == "get_attr" or node in weights:
                    found.kind[sid] = "weight"
                elif node.op == "placeholder":
                    found.kind[sid] = "input"
                else:
                    found.kind[sid] = "new"
            ids.append(keys[key])
        found.refs[node] = tuple(ids)
    return found


def _read(node: torch.fx.Node, arg: torch.fx.Node, refs: Mapping[torch.fx.Node, tuple[int, ...]]) -> tuple[int, ...]:
    """The storages ``node`` reads through ``arg`` (a ``getitem`` reads only its own leaf)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return refs.get(node, ())
    return refs.get(arg, ())


def check_order(graph: torch.fx.Graph, order: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """``order`` as a list, or ValueError unless it runs every op of ``graph`` once, after its inputs."""
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        raise TypeError(f"order must be a sequence of the graph's call_function nodes, got {type(order).__name__}")
    ops = [node for node in graph.nodes if node.op == "call_function"]
    order = list(order)
    if len(order) != len(ops) or set(order) != set(ops):
        raise ValueError(
            f"order must list each of the graph's {len(ops)} call_function nodes once, got {len(order)} entries"
        )
    done: set[torch.fx.Node] = set()
    for node in order:
        missing = [arg.name for arg in _nodes.input_nodes(node) if arg.op == "call_function" and arg not in done]
        if missing:
            raise ValueError(f"order runs {node.name} before its input {missing[0]}")
        done.add(node)
    return order


def graph_timeline(
    graph_module: torch.fx.GraphModule | torch.fx.Graph,
    *,
    order: Sequence[torch.fx.Node] | None = None,
    weights: Iterable[torch.fx.Node] = (),
    name: str = "graph",
) -> Timeline:
    """The buffers of one graph run op by op in ``order`` (default: the written order)."""
    graph = graph_module.graph if isinstance(graph_module, torch.fx.GraphModule) else graph_module
    ops = check_order(graph, order) if order is not None else [n for n in graph.nodes if n.op == "call_function"]
    found = storages_of(graph, weights)
    timeline = Timeline(
        steps=[n.name for n in ops],
        step_graphs=[name] * len(ops),
        weights=found.bytes_of("weight"),
        inputs=found.bytes_of("input"),
    )
    spans = lifetimes(graph, ops, found)
    timeline.buffers = [
        Buffer(found.names[sid], found.device[sid], found.nbytes[sid], start, end, kind, name)
        for sid, (start, end, kind) in spans.items()
    ]
    return timeline


def lifetimes(
    graph: torch.fx.Graph,
    ops: Sequence[torch.fx.Node],
    found: Storages,
    holds: Iterable[tuple[torch.fx.Node, int]] = (),
) -> dict[int, tuple[int, int, str]]:
    """``{storage id: (start, end, kind)}`` for the storages the steps ``ops`` create.

    ``holds``: (node, step) pairs keeping a node's storages alive at least to that step
    (a split holds its inputs until it ends).
    """
    step = {node: index for index, node in enumerate(ops)}
    if len(step) != len(ops):
        raise ValueError("order lists a node twice")
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for index, node in enumerate(ops):
        for sid in found.refs.get(node, ()):
            if found.kind[sid] == "new" and sid not in start:
                start[sid] = end[sid] = index
    for node in ops:
        for arg in _nodes.input_nodes(node):
            for sid in _read(node, arg, found.refs):
                if sid in end:
                    end[sid] = max(end[sid], step[node])
    for node, at in holds:
        for sid in found.refs.get(node, ()):
            if sid in end:
                end[sid] = max(end[sid], at)
    outputs: set[int] = set()
    last = len(ops) - 1
    for node in graph.nodes:
        if node.op == "output":
            torch.fx.node.map_arg(node.args, lambda arg: outputs.update(found.refs.get(arg, ())))
    for sid in outputs & set(end):
        end[sid] = last
    return {sid: (start[sid], end[sid], "output" if sid in outputs else "activation") for sid in start}
