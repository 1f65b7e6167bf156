"""What the planner reads from a model's run on fake tensors (private): the memory of the
planned forward, and of a generation's last decode step.

Per ``nn.Linear`` / ``nn.Embedding`` leaf, the trace also records the rows it computed (what
its time scales with), the most rows of one call (what one call's buffers scale with) and
the steps of the timeline its forward covered, from which the activation bytes alive while
it computes are read: a decoded weight's copy comes on top of those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tightfit._validate import check_count, check_type

__all__ = ["DECODE", "DecodeTrace", "Leaves", "Traced", "trace_decode", "trace_forward"]

#: The phase a :class:`DecodeTrace` script names before its one-token forward.
DECODE = "decode"


@dataclass
class Leaves:
    """Per leaf: rows summed over its calls, the most rows of one call, and the steps
    (start, end) each call covered."""

    rows: dict[str, int] = field(default_factory=dict)
    call_rows: dict[str, int] = field(default_factory=dict)
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Traced:
    """A phase as the planner prices it: its activation peak (inputs included), the node it
    is at, and per leaf the activation bytes alive while the leaf computes."""

    activation_bytes: int
    peak_node: str | None
    live: dict[str, int]


@dataclass(frozen=True)
class DecodeTrace:
    """A generation's last one-token forward, at the longest context it plans for, for
    ``fit(..., decode=...)`` to trace beside the planned forward (the prefill): the step
    where the KV cache is largest, whose peak the plan must hold too.

    ``script(calls)`` (:class:`tightfit.memory.simulate.Calls`) makes it on fake tensors:
    a forward that fills the cache to ``context - 1`` positions, then
    ``calls.phase("decode")`` and the one-token forward that grows it to ``context``,
    holding between them only what a generation holds (the cache, the next token).
    ``kv_format`` names the cache's format and ``kv_cache_bytes`` its bytes at ``context``:
    shown in the plan, not added to it (the trace holds the cache)."""

    script: Callable[[Any], None]
    context: int
    kv_format: str
    kv_cache_bytes: int

    def __post_init__(self) -> None:
        if not callable(self.script):
            raise TypeError(f"DecodeTrace.script must be callable, got {type(self.script).__name__}: {self.script!r}")
        check_count("DecodeTrace.context", self.context)
        if self.context < 1:
            raise ValueError(f"DecodeTrace.context must be >= 1, got {self.context}")
        check_type("DecodeTrace.kv_format", self.kv_format, str)
        if not self.kv_format:
            raise ValueError("DecodeTrace.kv_format must name the cache's format, got ''")
        check_count("DecodeTrace.kv_cache_bytes", self.kv_cache_bytes)

    def summary(self) -> dict[str, Any]:
        """What a plan keeps of it: the cache's format, its context and bytes there."""
        return {"format": self.kv_format, "context": self.context, "bytes": self.kv_cache_bytes}


@contextlib.contextmanager
def _recording(model: nn.Module) -> Iterator[Leaves]:
    """Hooks on every Linear and Embedding leaf recording :class:`Leaves` while a simulation runs."""
    from tightfit.memory.simulate import current_step

    leaves = Leaves()
    starts: dict[str, list[int | None]] = {}

    def enter(name: str, module: nn.Module, inputs: tuple) -> None:
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if x is not None:
            count = x.numel() // module.in_features if isinstance(module, nn.Linear) else x.numel()
            leaves.rows[name] = leaves.rows.get(name, 0) + count
            leaves.call_rows[name] = max(leaves.call_rows.get(name, 0), count)
        starts.setdefault(name, []).append(current_step())

    def leave(name: str) -> None:
        start, end = starts[name].pop(), current_step()
        if start is not None and end is not None:
            leaves.spans.setdefault(name, []).append((start, end))

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            handles.append(module.register_forward_pre_hook(lambda m, inputs, name=name: enter(name, m, inputs)))
            handles.append(module.register_forward_hook(lambda m, inputs, output, name=name: leave(name)))
    try:
        yield leaves
    finally:
        for handle in handles:
            handle.remove()


def _live_per_leaf(
    live: list[int], spans: dict[str, list[tuple[int, int]]], inputs: int, fallback: int
) -> dict[str, int]:
    """Per leaf, the most activation bytes (and ``inputs``) alive during its forward
    (``fallback`` where the timeline cannot tell: the whole activation peak)."""
    found = {}
    for name, ranges in spans.items():
        steps = [live[step] for start, end in ranges for step in range(start, min(end, len(live)))]
        found[name] = inputs + max(steps) if steps else fallback
    return found


def trace_forward(model: nn.Module, args: tuple, kwargs: dict, backend: Any) -> tuple[Traced, Leaves]:
    """The planned forward's eager memory on the backend's device, and its leaves."""
    from tightfit.memory import plan_memory

    with _recording(model) as leaves:
        memory = plan_memory(model, *args, kwargs=kwargs, backend=backend, runtime="eager")
    key = str(backend.device)
    planned = memory.devices.get(key)
    if planned is None:
        return Traced(0, None, {}), leaves
    activations = planned.live_peak_bytes + planned.inputs_bytes
    live = _live_per_leaf(memory.live_bytes(key), leaves.spans, planned.inputs_bytes, activations)
    return Traced(activations, planned.peak_node, live), leaves


def trace_decode(model: nn.Module, decode: DecodeTrace, device: torch.device) -> Traced:
    """The decode step's memory: the most alive over its steps (the cache at its context, the
    next token, what the step makes), and per leaf what is alive while it computes in it."""
    from tightfit.memory.simulate import simulate_calls
    from tightfit.memory.trace import refuse_data_dependence

    with _recording(model) as leaves, refuse_data_dependence(model):
        timeline = simulate_calls(model, decode.script, device=device)
    steps = [step for step, phase in enumerate(timeline.step_graphs) if phase == DECODE]
    if not steps:
        raise ValueError(
            f"the decode script ran no op after calls.phase({DECODE!r}); it must make the one-token forward"
        )
    live = timeline.live_bytes(str(device))
    peak = max(steps, key=lambda step: live[step])
    first = steps[0]
    spans = {name: kept for name, ranges in leaves.spans.items() if (kept := [r for r in ranges if r[0] >= first])}
    return Traced(live[peak], timeline.steps[peak], _live_per_leaf(live, spans, 0, live[peak]))
