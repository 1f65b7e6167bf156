"""Eager lifetimes: run the module on fake tensors and watch when each storage dies.

Eager PyTorch frees a tensor when Python drops its last reference, and Python code
often holds a value long after its last use in the graph (a local variable until the
function returns). No graph can tell when; the module's own code can. So the eager plan
runs the module once on fake tensors (no real byte allocated), under a dispatch mode
that records, for every storage an op creates, the step it is born and the step after
which no Python object refers to it any longer, which is what the caching allocator or
``malloc`` sees in a real run. Training runs the backward from the loss too; the
loss stays alive to the end and the gradients too, as ``.grad`` does; the other outputs
are dropped before the backward, as a training step that keeps only the loss drops them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tightfit.graph.alloc.liveness import Buffer, Timeline
from tightfit.memory.trace import _flatten, _loss_outputs

__all__ = ["current_step", "simulate_eager"]


class _Lifetimes(TorchDispatchMode):
    """Birth and death steps of the storages ops create (storages seen first as inputs are not ours)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[str] = []
        self.step_graphs: list[str] = []
        self.graph = "inference"
        self.alive: dict[StorageWeakRef, int] = {}  # -> index into born
        self.born: list[list[Any]] = []  # [name, device, nbytes, start, end]
        self.foreign: set[StorageWeakRef] = set()

    def _reap(self, end: int) -> None:
        for ref in [ref for ref in self.alive if ref.expired()]:
            self.born[self.alive.pop(ref)][4] = end

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "prim":  # metadata queries (prim::device, ...): no storage, no step
            return func(*args, **(kwargs or {}))
        step = len(self.steps)
        self._reap(step - 1)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.Tensor):
                ref = StorageWeakRef(leaf.untyped_storage())
                if ref not in self.alive:
                    self.foreign.add(ref)
        result = func(*args, **(kwargs or {}))
        name = f"{func._schema.name.split('::')[-1]}_{step}"
        self.steps.append(name)
        self.step_graphs.append(self.graph)
        for index, leaf in enumerate(tree_flatten(result)[0]):
            if not isinstance(leaf, torch.Tensor):
                continue
            storage = leaf.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref in self.alive or ref in self.foreign:
                continue
            self.alive[ref] = len(self.born)
            self.born.append([name if index == 0 else f"{name}[{index}]", str(leaf.device), int(storage.nbytes()), step, step])
        return result

    def finish(self, kept: Sequence[torch.Tensor]) -> list[Buffer]:
        last = len(self.steps) - 1
        self._reap(last)
        kept_refs = {StorageWeakRef(t.untyped_storage()) for t in kept}
        buffers = []
        for ref, index in self.alive.items():
            self.born[index][4] = last
        for name, device, nbytes, start, end in self.born:
            buffers.append(Buffer(name, device, nbytes, start, max(start, end), "activation", self.step_graphs[start]))
        outputs = {self.alive[ref] for ref in kept_refs if ref in self.alive}
        return [Buffer(b.name, b.device, b.nbytes, b.start, b.end, "output", b.graph) if i in outputs else b
                for i, b in enumerate(buffers)]


def current_step() -> int | None:
    """The step the eager simulation running now will record next, or None outside one.

    Code called during the simulated run (a module's forward hooks) uses it to tell
    which steps of the timeline a module's forward covers.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _Lifetimes):
            return len(mode.steps)
    return None


def _bytes_by_device(tensors: Sequence[torch.Tensor]) -> dict[str, int]:
    seen: dict[int, tuple[str, int]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = (str(tensor.device), int(storage.nbytes()))
    totals: dict[str, int] = {}
    for device, nbytes in seen.values():
        totals[device] = totals.get(device, 0) + nbytes
    return totals


def simulate_eager(model: torch.nn.Module, example_inputs: Sequence[Any], kwargs: Mapping[str, Any], *,
                   device: torch.device, training: bool) -> Timeline:
    """The timeline of one eager call (training: forward and backward) on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    flat = _flatten(model, example_inputs, kwargs, mode, device, training)
    if training and not any(t.requires_grad for t in flat.state + flat.fakes):
        raise ValueError(f"training=True, but nothing {type(model).__name__} reads requires grad")
    recorder = _Lifetimes()
    recorder.graph = "forward" if training else "inference"
    with mode, recorder:
        if training:
            outs = flat(*flat.state, *flat.fakes)
            chosen = _loss_outputs(outs, type(model).__name__)
            del outs  # a training step keeps the loss, not the other outputs
            recorder.graph = "backward"
            torch.autograd.backward(chosen, [torch.ones_like(out) for out in chosen])
            kept = chosen + [t.grad for t in flat.state + flat.fakes if t.grad is not None]
            del chosen
        else:
            with torch.no_grad():
                kept = list(flat(*flat.state, *flat.fakes))
    if not recorder.steps:
        raise ValueError(f"{type(model).__name__} ran no op; there is nothing to plan")
    buffers = recorder.finish(kept)
    return Timeline(steps=recorder.steps, step_graphs=recorder.step_graphs, buffers=buffers,
                    weights=_bytes_by_device(flat.state), inputs=_bytes_by_device(flat.fakes))
