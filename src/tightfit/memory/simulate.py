"""Eager lifetimes: run the module on fake tensors and watch when each storage dies.

Eager PyTorch frees a tensor when Python drops its last reference, and Python code
often holds a value long after its last use in the graph (a local variable until the
function returns). No graph can tell when; the module's own code can. So the eager plan
runs the module once on fake tensors (no real byte allocated) under the lifetime tracker
that measures real runs (:class:`tightfit.memory.LiveTensorBytes`): it records, for every
storage an op creates, the step it is born and the step after which no Python object
refers to it any longer, which is what the caching allocator or ``malloc`` sees in a
real run. :func:`simulate_calls` runs a script of several calls instead (a generation's
decode step after the forward that fills its cache), each step labelled with the phase the
script names. Training runs the backward from the loss too; the loss stays alive to the end
and the gradients too, as ``.grad`` does; the other outputs are dropped before the
backward, as a training step that keeps only the loss drops them.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tightfit.graph.alloc.liveness import Buffer, Timeline
from tightfit.memory._meta_kernels import lenient_meta_kernels
from tightfit.memory.measure import LiveTensorBytes
from tightfit.memory.trace import _flatten, _loss_outputs

__all__ = ["Calls", "current_step", "simulate_calls", "simulate_eager"]

_SIMULATION: contextvars.ContextVar[LiveTensorBytes | None] = contextvars.ContextVar(
    "tightfit_simulation", default=None
)


def _buffers(tracker: LiveTensorBytes, kept: Sequence[torch.Tensor]) -> list[Buffer]:
    """The tracker's lifetimes as buffers; still alive at the end: alive to the last step, ``kept``: outputs."""
    last = len(tracker.steps) - 1
    outputs = set(tracker.alive(kept))
    return [
        Buffer(
            life.name,
            life.device,
            life.nbytes,
            life.start,
            last if life.end is None else max(life.start, life.end),
            "output" if index in outputs else "activation",
            tracker.step_phases[life.start],
        )
        for index, life in enumerate(tracker.lifetimes)
    ]


def current_step() -> int | None:
    """The step the eager simulation running now will record next, or None outside one.

    Code called during the simulated run (a module's forward hooks) uses it to tell
    which steps of the timeline a module's forward covers.
    """
    tracker = _SIMULATION.get()
    return None if tracker is None else len(tracker.steps)


def _bytes_by_device(tensors: Sequence[torch.Tensor]) -> dict[str, int]:
    seen: dict[int, tuple[str, int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = (str(tensor.device), int(storage.nbytes()))
    totals: dict[str, int] = {}
    for device, nbytes in seen.values():
        totals[device] = totals.get(device, 0) + nbytes
    return totals


def _timeline(
    recorder: LiveTensorBytes,
    kept: Sequence[torch.Tensor],
    state: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    nothing: str,
) -> Timeline:
    """What ``recorder`` saw as a timeline (``kept``: the outputs, alive to the end; the
    weights and inputs by device); ``nothing``: the error's words where it saw no op."""
    if not recorder.steps:
        raise ValueError(f"{nothing}; there is nothing to plan")
    return Timeline(
        steps=recorder.steps,
        step_graphs=recorder.step_phases,
        buffers=_buffers(recorder, kept),
        weights=_bytes_by_device(state),
        inputs=_bytes_by_device(inputs),
    )


def simulate_eager(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    device: torch.device,
    training: bool,
    mode: Any = None,
) -> Timeline:
    """The timeline of one eager call (training: forward and backward) on fake tensors.

    ``mode``: the ``FakeTensorMode`` the model's tensors are fakes of already (a skeleton
    converted under it: a quantized layer's scales, which are no parameter or buffer, are
    then used as they are); default: a new one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode() if mode is None else mode
    flat = _flatten(model, example_inputs, kwargs, mode, device, training)
    if training and not any(t.requires_grad for t in flat.state + flat.fakes):
        raise ValueError(f"training=True, but nothing {type(model).__name__} reads requires grad")
    recorder = _InPlaceAccumulation(flat.state) if training else LiveTensorBytes(None)
    recorder.phase = "forward" if training else "inference"
    token = _SIMULATION.set(recorder)
    try:
        with mode, recorder, lenient_meta_kernels(), flat.holding():
            if training:
                outs = flat(*flat.state, *flat.fakes)
                chosen = _loss_outputs(outs, type(model).__name__)
                del outs  # a training step keeps the loss, not the other outputs
                recorder.phase = "backward"
                torch.autograd.backward(chosen, [torch.ones_like(out) for out in chosen])
                kept = chosen + [t.grad for t in flat.state + flat.fakes if t.grad is not None]
                del chosen
            else:
                with torch.no_grad():
                    kept = list(flat(*flat.state, *flat.fakes))
    finally:
        _SIMULATION.reset(token)
    return _timeline(recorder, kept, flat.state, flat.fakes, f"{type(model).__name__} ran no op")


class _InPlaceAccumulation(LiveTensorBytes):
    """The tracker, with the backward's sums of a weight's gradients (a weight used twice: a
    module called twice, a tied weight) made in place into the first, as eager PyTorch's
    autograd makes them: it adds out of place while any dispatch mode runs (the fake mode,
    this tracker), which would count a copy of the weight's gradient at every sum. Only the
    engine's own sums (grad mode off; a checkpointed forward recomputed in the backward runs
    with it on) of gradients shaped as a weight that trains: an activation's gradients, where
    the engine sums in place only if nothing else holds them, are left out of place."""

    def __init__(self, leaves: Sequence[torch.Tensor]) -> None:
        super().__init__(None)
        self._weights = {(tuple(leaf.shape), leaf.dtype) for leaf in leaves if leaf.requires_grad}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        summing = func is torch.ops.aten.add.Tensor and not kwargs and not torch.is_grad_enabled()
        if summing and self.phase == "backward" and self._sums(*args):
            super().__torch_dispatch__(torch.ops.aten.add_.Tensor, types, args)
            return args[0]
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _sums(self, first: Any, second: Any = None, *rest: Any) -> bool:
        """Whether ``first + second`` sums two gradients of a weight the backward made."""
        tensors = (first, second)
        if rest or not all(isinstance(t, torch.Tensor) for t in tensors):
            return False
        if first.shape != second.shape or first.dtype != second.dtype or not first.is_contiguous():
            return False
        if (tuple(first.shape), first.dtype) not in self._weights:
            return False
        for tensor in tensors:
            index = self._index.get(StorageWeakRef(tensor.untyped_storage()))
            if index is None or self.step_phases[self.lifetimes[index].start] != "backward":
                return False
        return True


@dataclass(frozen=True)
class Calls:
    """What the script of :func:`simulate_calls` is given: ``call(*args, **kwargs)`` runs the
    model on its fake weights; ``phase(label)`` labels the steps from here on; tensors the
    script makes itself are fake (it runs under the fake mode) and belong on ``device``."""

    call: Callable[..., Any]
    phase: Callable[[str], None]
    device: torch.device


def simulate_calls(model: torch.nn.Module, script: Callable[[Calls], None], *, device: torch.device) -> Timeline:
    """The timeline of ``script(calls)``: eager calls of ``model`` in inference (no grad), on
    fake tensors, with what the script holds between them alive as it holds it (a KV cache
    the calls fill). Steps are labelled with the phases the script names ("" before the first)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    if not callable(script):
        raise TypeError(f"script must be a callable taking Calls, got {type(script).__name__}: {script!r}")
    mode = FakeTensorMode()
    flat = _flatten(model, (), {}, mode, device, False)
    weights = dict(zip(flat.names, flat.state))
    recorder = LiveTensorBytes(None)

    def phase(label: str) -> None:
        if not isinstance(label, str):
            raise TypeError(f"phase label must be a str, got {type(label).__name__}: {label!r}")
        recorder.phase = label

    calls = Calls(lambda *args, **kwargs: functional_call(model, weights, args, kwargs), phase, device)
    token = _SIMULATION.set(recorder)
    try:
        with mode, recorder, lenient_meta_kernels(), torch.no_grad():
            script(calls)
    finally:
        _SIMULATION.reset(token)
    return _timeline(recorder, [], flat.state, [], f"the script ran no op of {type(model).__name__}")
