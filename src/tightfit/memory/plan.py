"""``tightfit.plan_memory``: will a model fit, and where is its peak, before it runs.

The model is traced with fake tensors (see :mod:`tightfit.memory.trace`), each aten
graph goes through the compile backend's passes (assignment, DFS schedules, splits), and
:mod:`tightfit.graph.alloc` plans it: lifetimes, the best of the candidate orders, one
arena per device, verified. See docs/memory.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from tightfit._validate import check_choice, check_type
from tightfit.graph.alloc.arena import Arena
from tightfit.graph.alloc.layout import ArenaLayout, Outside, arena_layout
from tightfit.graph.alloc.liveness import Timeline
from tightfit.graph.alloc.order import TOPOLOGICAL_ORDERS, canonical_order, choose_order
from tightfit.graph.alloc.program import graph_plans, join_training, plan_arenas, total_bound
from tightfit.graph.alloc.verify import verify_arena

__all__ = ["COVERS", "LIMITS", "NOT_COVERED", "RUNTIMES", "DevicePlan", "MemoryPlan", "plan_memory"]

_LARGEST = 5  # tensors listed at the peak


@dataclass(frozen=True)
class DevicePlan:
    """The plan of one device.

    ``weights_bytes`` and ``inputs_bytes``: distinct weight and input storages there
    (not in the arena); ``arena_bytes``: the one buffer every activation, output and
    workspace is placed in; ``lower_bound_bytes``: the most bytes alive at once (sizes
    aligned), below which no arena can go; ``live_peak_bytes``: the same with exact
    sizes, what a live-tensor counter measures in an op-by-op run; the peak is at
    ``peak_step``, running ``peak_node`` of graph ``peak_graph``, with ``largest_live``
    (name, graph, bytes) the largest tensors alive there; ``strategy``: the arena strategy
    that packed it (``placement`` before; the old name works for one release).
    """

    device: str
    weights_bytes: int
    inputs_bytes: int
    arena_bytes: int
    lower_bound_bytes: int
    live_peak_bytes: int
    peak_step: int | None
    peak_node: str | None
    peak_graph: str | None
    largest_live: tuple[tuple[str, str, int], ...]
    strategy: str

    @property
    def placement(self) -> str:
        """Deprecated: :attr:`strategy`."""
        warnings.warn(
            "DevicePlan.placement is renamed DevicePlan.strategy; placement goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.strategy

    @property
    def ratio(self) -> float:
        """Arena over lower bound (1.0 for an empty arena)."""
        return self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    @property
    def total_bytes(self) -> int:
        """Weights, inputs and the arena: what the device must hold."""
        return self.weights_bytes + self.inputs_bytes + self.arena_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """What ``tightfit.plan_memory`` returns: per device, weights, arena and lower bound.

    ``print(plan)`` shows a table; ``plan.plot(path)`` writes a PNG timeline;
    ``plan.verify()`` re-checks that no two live tensors overlap in any arena;
    ``plan.to_dict()`` gives the figures as plain data (``tightfit plan --json``).
    ``runtime="arena"`` only: ``run_arenas`` (graph -> device -> bytes) are the buffers
    arena execution allocates, and ``outside`` the storages it allocates as usual
    (what made them, their bytes, and why they are not in the arena).
    ``covers`` names the run the figures predict, ``limits`` what they leave out of it.
    """

    model: str
    training: bool
    runtime: str
    backend: str
    alignment: int
    devices: Mapping[str, DevicePlan]
    orders: Mapping[str, str]  # graph -> the order kept
    order_peaks: Mapping[str, Mapping[str, int]]  # graph -> {order: total lower bound}
    timeline: Timeline = field(repr=False)
    arenas: Mapping[str, Arena] = field(repr=False)
    run_arenas: Mapping[str, Mapping[str, int]] = field(default_factory=lambda: MappingProxyType({}))
    outside: tuple[Outside, ...] = ()

    @property
    def covers(self) -> str:
        """The run this plan's figures predict (see :data:`COVERS`); :data:`NOT_COVERED` is not."""
        moved = {graph: order for graph, order in self.orders.items() if order != "written"}
        if self.runtime == "compiled" and moved:
            kept = ", ".join(f"{graph} {order}" for graph, order in moved.items())
            return (
                f"{COVERS['compiled']} once the order kept ({kept}) is applied with tightfit.graph.alloc.apply_order "
                "(the backend runs the written order: plan order='written' for it)"
            )
        return COVERS[self.runtime]

    @property
    def limits(self) -> str:
        """What this plan's figures leave out of the run they cover (see :data:`LIMITS`)."""
        return LIMITS[self.runtime]

    @property
    def graphs(self) -> tuple[str, ...]:
        return tuple(self.orders)

    def verify(self) -> None:
        """Raise :class:`tightfit.graph.alloc.PlanError` if two live tensors overlap in an arena."""
        for arena in self.arenas.values():
            verify_arena(arena)

    def live_bytes(self, device: str) -> list[int]:
        """Bytes alive in ``device``'s arena at each step (exact sizes)."""
        check_type("device", device, str)
        if device not in self.devices:
            raise ValueError(f"device={device!r} is not in the plan; planned: {', '.join(self.devices)}")
        return self.timeline.live_bytes(device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "training": self.training,
            "runtime": self.runtime,
            "backend": self.backend,
            "alignment": self.alignment,
            "covers": self.covers,
            "limits": self.limits,
            "not_covered": NOT_COVERED,
            "steps": len(self.timeline.steps),
            "orders": dict(self.orders),
            "order_peaks": {g: dict(p) for g, p in self.order_peaks.items()},
            "devices": {
                name: {
                    "weights_bytes": d.weights_bytes,
                    "inputs_bytes": d.inputs_bytes,
                    "arena_bytes": d.arena_bytes,
                    "lower_bound_bytes": d.lower_bound_bytes,
                    "live_peak_bytes": d.live_peak_bytes,
                    "ratio": d.ratio,
                    "total_bytes": d.total_bytes,
                    "strategy": d.strategy,
                    "peak_step": d.peak_step,
                    "peak_node": d.peak_node,
                    "peak_graph": d.peak_graph,
                    "largest_live": [{"tensor": n, "graph": g, "bytes": b} for n, g, b in d.largest_live],
                }
                for name, d in self.devices.items()
            },
            "run_arenas": {graph: dict(sizes) for graph, sizes in self.run_arenas.items()},
            "outside": [
                {
                    "graph": o.graph,
                    "tensor": o.name,
                    "op": o.op,
                    "device": o.device,
                    "bytes": o.nbytes,
                    "reason": o.reason,
                }
                for o in self.outside
            ],
        }

    def __str__(self) -> str:
        from tightfit.memory.report import render

        return render(self)

    def plot(self, path: str | Path) -> Path:
        """Write a PNG of live bytes per device over the steps, with the lower bound and arena marked."""
        from tightfit.memory.report import plot

        return plot(self, path)


def _device_plan(timeline: Timeline, arena: Arena | None, device: str, alignment: int) -> DevicePlan:
    step = timeline.peak_step(device, alignment)
    alive = timeline.live_at(device, step) if step is not None else []
    return DevicePlan(
        device=device,
        weights_bytes=timeline.weights.get(device, 0),
        inputs_bytes=timeline.inputs.get(device, 0),
        arena_bytes=arena.size if arena else 0,
        lower_bound_bytes=timeline.lower_bound(device, alignment),
        live_peak_bytes=timeline.lower_bound(device),
        peak_step=step,
        peak_node=timeline.steps[step] if step is not None else None,
        peak_graph=timeline.step_graphs[step] if step is not None else None,
        largest_live=tuple((b.name, b.graph, b.nbytes) for b in alive[:_LARGEST]),
        strategy=arena.strategy if arena else "-",
    )


def _check_alignment(alignment: Any) -> int:
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        raise TypeError(f"alignment must be int, got {type(alignment).__name__}: {alignment!r}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment={alignment} is not accepted; accepted: a power of two >= 1 (bytes)")
    return alignment


def _plan_compiled(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    kwargs: dict[str, Any],
    backends: list[Any],
    device: torch.device,
    training: bool,
    order: str,
    alignment: int,
    arena: bool,
) -> tuple[Timeline, dict[str, str], dict[str, dict[str, int]], list[ArenaLayout]]:
    """The timeline of the aten graphs the compile backend gets, split as it splits them, in the best order
    (``arena``: in the written order, as arena execution runs them, with the arena layouts)."""
    from tightfit.graph.compile import CompileOptions, split_graph
    from tightfit.memory.trace import trace

    traced = trace(model, example_inputs, kwargs, device=device, training=training)
    options = CompileOptions(backends=tuple(backends))
    orders = TOPOLOGICAL_ORDERS if order == "best" else (order,)
    candidates = []
    layouts = []
    for index, (name, graph_module) in enumerate(traced.graphs):
        splits, _, _ = split_graph(graph_module, options=options, name=name)
        placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
        weights = placeholders[: traced.weights] if index == 0 else ()
        released = [placeholders[position] for _, position in traced.saved] if index == 1 else ()
        plans = graph_plans(
            graph_module,
            splits=splits,
            weights=weights,
            orders=orders,
            released=released,
            name=name,
            alignment=alignment,
        )
        if arena:
            layout = arena_layout(graph_module, splits, name=name, plan=plans["written"])  # the run's alignment
            timeline = layout.timeline(plans["written"].timeline)
            plans = {
                "written": replace(
                    plans["written"], timeline=timeline, order_peaks={"written": total_bound(timeline, alignment)}
                )
            }
            layouts.append(layout)
        candidates.append(plans)
    first = candidates[0][choose_order(next(iter(candidates[0].values())).order_peaks)]
    chosen = [first]
    timeline = first.timeline
    if training:  # the backward's order is judged on the whole step: it frees what the forward saved
        joined = {name: join_training(first, plan, traced.saved, traced.losses) for name, plan in candidates[1].items()}
        peaks = {name: total_bound(joined_timeline, alignment) for name, joined_timeline in joined.items()}
        best = choose_order(peaks)
        chosen.append(replace(candidates[1][best], order_peaks=peaks))
        timeline = joined[best]
    return (
        timeline,
        {plan.name: plan.order for plan in chosen},
        {plan.name: plan.order_peaks for plan in chosen},
        layouts,
    )


#: How the planned graphs run: as the tightfit compile backend runs them (splits, DFS
#: regions, copies between devices), with results allocated as usual ("compiled") or
#: inside the planned arena ("arena": ``options={"memory": "arena"}``), or op by op as
#: PyTorch's eager mode does ("eager": each tensor freed when Python drops it).
RUNTIMES = ("compiled", "arena", "eager")

#: The run each runtime's figures predict: the tests and benchmarks/memory_plan.py hold
#: each to the allocator's own count (:func:`tightfit.memory.allocated_peak`), within 5%.
COVERS = MappingProxyType(
    {
        "compiled": 'torch.compile(model, backend=tightfit.graph.compiler(execution="fx"))',
        "arena": 'torch.compile(model, backend=tightfit.graph.compiler(memory="arena")), DFS splits as with execution="fx"',
        "eager": "model(...) run by eager PyTorch",
    }
)

_KERNEL_SCRATCH = (
    "scratch allocated inside native kernels (convolution workspaces) is not predicted: it depends on the "
    "kernel library and the CPU, not on shapes (on the CPU, oneDNN convolutions copy their input, weights and "
    "output into blocked layouts and free them within the op); tightfit.memory.allocated_peak measures it"
)

#: What each runtime's figures leave out of the run they cover (:data:`COVERS`): a plan says
#: it as ``plan.limits``, and its report prints it under ``predicts:``.
LIMITS = MappingProxyType(
    {
        "compiled": _KERNEL_SCRATCH,
        "arena": _KERNEL_SCRATCH + "; under arena execution it comes on top of the whole arena",
        "eager": _KERNEL_SCRATCH,
    }
)

#: What no plan predicts, and why: ``runtime="inductor"`` (or ``"auto"``) is refused with it.
NOT_COVERED = (
    "inductor or a backend's own compiler running the splits (the compile backend's default execution=\"auto\" "
    'where one compiles, or execution="inductor"): they fuse ops and reuse buffers their own way'
)


def plan_memory(
    model: torch.nn.Module,
    *example_inputs: Any,
    backend: Any = None,
    training: bool = False,
    kwargs: Mapping[str, Any] | None = None,
    order: str = "best",
    runtime: str = "compiled",
    alignment: int = 64,
) -> MemoryPlan:
    """Plan the memory of ``model(*example_inputs, **kwargs)`` without running it.

    ``backend``: a backend name, device or ``Backend`` (default: the default backend);
    the model's weights and inputs are planned on its device, whatever device they are
    on now (``meta`` included). ``training``: plan the forward and the backward (from the
    scalar outputs that need a gradient, such as a loss, else from every output that
    does); the module's own ``train()``/``eval()`` mode is kept. ``order``: "best" (the
    candidate order with the lowest peak) or one of "written", "depth-first",
    "breadth-first", "least-peak" ("dfs" and "bfs", their old names, are deprecated). ``runtime``: "compiled" (as ``torch.compile(model, backend="tightfit")``
    runs its splits with ``execution="fx"``, op by op; inductor's own buffers are not
    predicted: :data:`NOT_COVERED`), "arena" (the same with ``options={"memory": "arena"}``:
    written order, each graph's results in one arena per device; ``outside`` lists what
    is not) or "eager" (op by op in the written order, as PyTorch runs the module).
    ``plan.covers`` names the run the figures predict (:data:`COVERS`), ``plan.limits``
    what they leave out of it (:data:`LIMITS`: scratch inside native kernels).
    ``alignment``: of every offset and size in an arena, in bytes (arena execution
    always aligns its own arenas to ``tightfit.graph.alloc.ARENA_ALIGNMENT``).
    """
    from tightfit.backends.resolve import resolve_backend
    from tightfit.memory.simulate import simulate_eager
    from tightfit.memory.trace import refuse_data_dependence

    check_type("model", model, torch.nn.Module)
    check_type("training", training, bool)
    order = canonical_order(order)
    alignment = _check_alignment(alignment)
    check_type("runtime", runtime, str)
    if runtime in ("inductor", "auto"):
        raise ValueError(
            f"runtime={runtime!r} is not predicted: {NOT_COVERED}. Plan runtime='compiled' and run with "
            "execution='fx', or measure the compiled call with tightfit.memory.allocated_peak; accepted: "
            f"{', '.join(RUNTIMES)}"
        )
    check_choice("runtime", runtime, RUNTIMES)
    if runtime in ("eager", "arena") and order not in ("best", "written"):
        raise ValueError(
            f"order={order!r} with runtime={runtime!r}: {runtime} execution runs the written order; "
            "accepted: 'best' or 'written'"
        )
    if kwargs is not None:
        check_type("kwargs", kwargs, Mapping)
    backends, device = resolve_backend(backend)
    if runtime == "eager":
        with refuse_data_dependence(model):
            timeline = simulate_eager(model, example_inputs, dict(kwargs or {}), device=device, training=training)
        graphs = tuple(dict.fromkeys(timeline.step_graphs))
        orders = {graph: "written" for graph in graphs}
        order_peaks = {graph: {} for graph in graphs}
        layouts = []
    else:
        with refuse_data_dependence(model):
            timeline, orders, order_peaks, layouts = _plan_compiled(
                model,
                example_inputs,
                dict(kwargs or {}),
                backends,
                device,
                training,
                "written" if runtime == "arena" else order,
                alignment,
                runtime == "arena",
            )
    arenas = plan_arenas(timeline, alignment)
    for arena in arenas.values():
        verify_arena(arena)
    devices = {
        device_name: _device_plan(timeline, arenas.get(device_name), device_name, alignment)
        for device_name in timeline.devices
    }
    return MemoryPlan(
        model=type(model).__name__,
        training=training,
        runtime=runtime,
        backend=backends[0].name,
        alignment=alignment,
        devices=MappingProxyType(devices),
        orders=MappingProxyType(orders),
        order_peaks=MappingProxyType({graph: MappingProxyType(dict(peaks)) for graph, peaks in order_peaks.items()}),
        timeline=timeline,
        arenas=MappingProxyType(arenas),
        run_arenas=MappingProxyType(
            {layout.name: MappingProxyType({d: a.size for d, a in layout.arenas.items()}) for layout in layouts}
        ),
        outside=tuple(entry for layout in layouts for entry in layout.outside),
    )
