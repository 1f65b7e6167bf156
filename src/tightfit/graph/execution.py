"""Execution: run the splits of a graph in order, as compiled code or as FX modules.

Each split runs as the code its backend compiles for it (``Backend.compile_split``),
else as inductor-compiled code where inductor works for the device, else as its FX
module (also when ``execution="fx"`` or the split keeps ``order="as_written"``). A DFS
split runs its slice body once per slice, on views of its inputs, and writes each
slice's outputs into results allocated once before the loop, so one slice's
intermediates are freed before the next starts. With ``memory="arena"``, whole splits
run op by op inside their planned arena (:mod:`tightfit.graph.alloc.run`).

:class:`Program` is what the compile backend hands to aot_autograd: a boxed callable
(it takes the list of inputs and frees values as soon as no later split reads them).
Splits are called boxed too: a split gets the only references to the inputs that no
later split reads, so FX and inductor code free each one after its last use inside
the split, as eager autograd frees a saved tensor after the node that needs it.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tightfit._strict import report_slow_path
from tightfit.graph import _nodes
from tightfit.graph.alloc.layout import ArenaLayout, arena_layout
from tightfit.graph.alloc.run import ArenaRun
from tightfit.graph.partition import Split
from tightfit.graph.schedules import SliceSchedule
from tightfit.graph.slicing import put, take

__all__ = ["EXECUTIONS", "MEMORY_MODES", "Program", "Step", "build_program", "observe_splits"]

#: How splits run: "auto" (the backend's own compiler, else inductor where it works,
#: else FX), "inductor" (an error where inductor cannot compile), "fx" (never compile).
EXECUTIONS = ("auto", "fx", "inductor")

#: Where results go: "allocator" (each allocated as usual: the caching allocator on a
#: GPU, ``malloc`` on the CPU) or "arena" (whole splits run op by op inside the planned
#: arena, one buffer per device; see docs/memory.md).
MEMORY_MODES = ("allocator", "arena")

Observer = Callable[[str, Split], None]
#: Process-wide, not per thread or context: autograd runs the backward of a graph on CUDA on a
#: device thread of its own, whose splits a per-context observer would never see.
_observers: tuple[Observer, ...] = ()
_observers_lock = threading.Lock()


@contextlib.contextmanager
def observe_splits(callback: Observer) -> Iterator[None]:
    """Call ``callback("start" | "end", split)`` around every split that runs while the
    block is open, on any thread (a GPU's backward runs on autograd's device thread).

    For measurements, such as one region's peak memory (benchmarks/schedules.py).
    """
    global _observers
    if not callable(callback):
        raise TypeError(f"callback must be callable, got {type(callback).__name__}: {callback!r}")
    with _observers_lock:
        _observers = (*_observers, callback)
    try:
        yield
    finally:
        with _observers_lock:
            kept = list(_observers)
            kept.remove(callback)
            _observers = tuple(kept)


def _examples(graph_module: torch.fx.GraphModule) -> list[Any]:
    return [node.meta.get("val") for node in graph_module.graph.nodes if node.op == "placeholder"]


Boxed = Callable[[list[Any]], tuple[Any, ...]]  # takes the list of inputs and clears it


def _boxed(run: Callable[..., Any]) -> Boxed:
    """``run`` with the boxed calling convention (as it is, if it has it already)."""
    if getattr(run, "_boxed_call", False):
        return run

    def call(args: list[Any]) -> tuple[Any, ...]:
        values = list(args)  # code taking its inputs positionally holds them to its end
        args.clear()
        return run(*values)

    return call


def _boxed_fx(graph_module: torch.fx.GraphModule) -> Boxed:
    """The FX module's code, generated to take a list and clear it: each input is freed after its last use."""
    codegen = getattr(torch.fx.graph, "_BoxedCodeGen", None)
    if codegen is None:  # an older torch: the interpreter frees values after their last use too
        return torch.fx.Interpreter(graph_module).boxed_run
    graph = copy.deepcopy(graph_module.graph)  # the split keeps its own graph and calling convention
    graph.set_codegen(codegen())
    boxed = torch.fx.GraphModule(graph_module, graph)
    return boxed.forward


def _conforming(run: Boxed, examples: Sequence[Any]) -> Boxed:
    """Compiled code assumes its example inputs' strides: restride an input that differs."""
    expected = [(tuple(x.shape), tuple(x.stride())) if isinstance(x, torch.Tensor) else None for x in examples]

    def call(args: list[Any]) -> tuple[Any, ...]:
        for index, layout in enumerate(expected):
            if (
                layout is not None
                and isinstance(args[index], torch.Tensor)
                and tuple(args[index].stride()) != layout[1]
            ):
                args[index] = torch.empty_strided(
                    layout[0], layout[1], dtype=args[index].dtype, device=args[index].device
                ).copy_(args[index])
        return run(args)

    return call


def _compile(split: Split, graph_module: torch.fx.GraphModule, execution: str) -> tuple[Boxed, str]:
    """The code that runs one split (or one slice body), boxed, and what it is."""
    if split.as_written or execution == "fx":
        return _boxed_fx(graph_module), "fx"
    examples = _examples(graph_module)
    own = split.backend.compile_split(graph_module, examples)
    if own is not None:
        return _conforming(_boxed(own), examples), f"compiled by backend {split.backend.name}"
    from tightfit.graph import inductor

    try:
        return _conforming(_boxed(inductor.compile_split(graph_module, examples)), examples), "inductor"
    except Exception as error:
        if execution == "inductor":
            raise RuntimeError(
                f"inductor could not compile split {split.index} for {split.device} "
                f"(execution='inductor'): {type(error).__name__}: {error}"
            ) from error
        report_slow_path(
            ("inductor", split.device.type),
            f"tightfit: inductor could not compile a split for {split.device} "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "running such splits as FX modules",
        )
    return _boxed_fx(graph_module), "fx"


class SlicedRun:
    """A DFS split: the slice body once per slice, outputs written into preallocated results."""

    def __init__(self, plan: SliceSchedule, device: torch.device, bodies: dict[int, Boxed]) -> None:
        self.plan = plan
        self.device = device
        self.bodies = bodies
        self.input_states = [plan.state(node) for node in plan.inputs]
        self.output_states = [plan.state(node) for node in plan.outputs]

    def __call__(self, boxed: list[Any]) -> tuple[Any, ...]:
        args = list(boxed)  # every slice reads the inputs: they are held to the end
        boxed.clear()
        extent = self.plan.extent
        results = [_nodes.allocate(_nodes.value(node), self.device) for node in self.plan.outputs]
        for start, length in self.plan.bounds():
            pieces = [take(arg, state, extent, start, length) for arg, state in zip(args, self.input_states)]
            outputs = self.bodies[length](pieces)
            del pieces
            for index, (result, state) in enumerate(zip(results, self.output_states)):
                put(result, outputs[index], state, extent, start, length)  # no loop variable holds an output on
            del outputs  # this slice's intermediates are gone before the next slice starts
        return tuple(results)


@dataclass
class Step:
    """One split and the code that runs it."""

    split: Split
    run: Boxed | ArenaRun
    how: str  # "fx", "inductor", "compiled by backend NAME", "arena"
    non_blocking: bool


def _step_non_blocking(split: Split) -> bool:
    """Copies into the split may be asynchronous (device-to-host must block)."""
    return bool(split.backend.capabilities().async_copy) and split.device.type != "cpu"


def _step(split: Split, execution: str) -> Step:
    non_blocking = _step_non_blocking(split)
    if split.plan is None:
        run, how = _compile(split, split.graph_module, execution)
        return Step(split, run, how, non_blocking)
    compiled = {length: _compile(split, body, execution) for length, body in split.plan.bodies.items()}
    hows = sorted({how for _, how in compiled.values()})
    bodies = {length: run for length, (run, _) in compiled.items()}
    return Step(split, SlicedRun(split.plan, split.device, bodies), "/".join(hows), non_blocking)


class Program:
    """The compiled form of one aten graph: splits in order (boxed calling convention)."""

    _boxed_call = True

    def __init__(
        self, graph_module: torch.fx.GraphModule, steps: list[Step], name: str, layout: ArenaLayout | None = None
    ) -> None:
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not class attributes
        self.name = name
        self.ledger: Any = None  # the compile's HintLedger: what was ignored, for reports
        self.layout = layout  # memory="arena": the arenas, and what is allocated outside them
        self.steps = steps
        graph = graph_module.graph
        self.placeholders = [node for node in graph.nodes if node.op == "placeholder"]
        self.constants = {
            node: _nodes.fetch_attr(graph_module, node.target)
            for node in graph.nodes
            if node.op == "get_attr" and _nodes.tensors(node)
        }
        self.output = next(node for node in graph.nodes if node.op == "output").args[0]
        kept: set[torch.fx.Node] = set()
        torch.fx.node.map_arg(self.output, kept.add)  # the graph's outputs live to the end
        last: dict[torch.fx.Node, int] = {}
        for index, step in enumerate(steps):
            for node in step.split.inputs:
                last[node] = index
        self.dead_after: list[list[torch.fx.Node]] = [[] for _ in steps]
        for node, index in last.items():
            if node not in kept and node not in self.constants:
                self.dead_after[index].append(node)

    @property
    def splits(self) -> list[Split]:
        return [step.split for step in self.steps]

    def __call__(self, args: list[Any]) -> Any:
        env: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, args))
        args.clear()  # boxed: the caller hands over its references
        env.update(self.constants)
        observers = _observers
        arenas: dict[str, torch.Tensor] = {}  # memory="arena": one buffer per device, freed when the graph returns
        for step, dead in zip(self.steps, self.dead_after):
            split = step.split
            for observer in observers:
                observer("start", split)
            inputs = [
                env[node].to(split.device, non_blocking=step.non_blocking) if node in split.copies else env[node]
                for node in split.inputs
            ]
            for node in dead:  # the split holds the only reference now, and frees it after its last use
                env.pop(node, None)
            outputs = step.run(inputs, arenas) if isinstance(step.run, ArenaRun) else step.run(inputs)
            env.update(zip(split.outputs, outputs))  # no loop variable holds an output into the next split
            del outputs
            for observer in observers:
                observer("end", split)
        return torch.fx.node.map_arg(self.output, env.__getitem__)


def _symbolic_shapes(graph_module: torch.fx.GraphModule) -> bool:
    """Whether a traced value has a shape or stride known only as a symbol (an arena is laid out in bytes)."""
    return any(
        not isinstance(size, int)
        for node in graph_module.graph.nodes
        for tensor in _nodes.tensors(node)
        for size in (*tensor.shape, *tensor.stride(), tensor.storage_offset())
    )


def build_program(
    graph_module: torch.fx.GraphModule, splits: list[Split], execution: str, name: str, memory: str = "allocator"
) -> Program:
    """Compile every split (per ``execution``) into a :class:`Program`; with
    ``memory="arena"``, whole splits run in their arena instead (DFS splits as usual)."""
    if memory == "arena" and _symbolic_shapes(graph_module):
        report_slow_path(
            ("arena", "symbolic shapes"),
            f"tightfit: arena execution needs static shapes, and graph {name} has symbolic ones (dynamo "
            "recompiled it for a new input shape); running it with the allocator (compile with dynamic=False "
            "to keep arena execution)",
        )
        memory = "allocator"
    if memory == "allocator":
        return Program(graph_module, [_step(split, execution) for split in splits], name)
    layout = arena_layout(graph_module, splits, name=name)
    steps = [
        _step(split, execution)
        if split.plan is not None
        else Step(split, ArenaRun(split, layout), "arena", _step_non_blocking(split))
        for split in splits
    ]
    return Program(graph_module, steps, name, layout)
