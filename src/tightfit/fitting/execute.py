"""Carrying out a plan, entry by entry: the one executor that :meth:`FitPlan.apply` (a
model in memory) and :func:`tightfit.load` (a checkpoint streaming in, plain or stored
quantized) all call, so a storage or a placement is carried out one way wherever the
weights come from. The loaders fill a unit's tensors, then ask the executor to store and
place it; ``apply`` has them all already.

Offloaded units are linked into one prefetch schedule at the end, whichever call
offloaded them (:func:`tightfit.hooks.offload.link_offloading`), and the plan's hints
are added: a loaded model runs as an applied one does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from tightfit.fitting.regions import add_hints
from tightfit.hooks import OFFLOADING, HookRegistry, apply_offloading
from tightfit.hooks._disk import MappedRegions
from tightfit.hooks.offload import link_offloading, offload_in_place
from tightfit.quant import StorageFormat, move_unregistered, storage_format, storage_formats

if TYPE_CHECKING:
    from tightfit.fitting.plan import FitPlan, PlanEntry

__all__ = ["PlanExecutor", "move_kept", "offload_units"]


class PlanExecutor:
    """Stores and places ``plan``'s units of ``model`` on ``device``, one entry at a time
    (:meth:`store`, then :meth:`place`), in the order of :attr:`entries`; :meth:`finish`
    after the last."""

    def __init__(self, model: nn.Module, plan: FitPlan, device: torch.device) -> None:
        self.model, self.plan, self.device = model, plan, device
        self.offloaded = {entry.module for entry in plan.entries if entry.placement != "device"}
        self._tied_done: set[str] = set()  # tied units offloaded already, with another of their placement

    @property
    def entries(self) -> tuple[PlanEntry, ...]:
        """The plan's entries in the order they are carried out: tied units first (one is
        offloaded over its modules' common parent, which must hold no offloaded unit yet),
        the rest of the model last (it moves what no unit holds)."""
        return tuple(sorted(self.plan.entries, key=lambda e: (e.kind == "rest", len(e.modules) < 2)))  # stable

    def store(self, entry: PlanEntry, leaves: Sequence[str] | None = None) -> None:
        """Convert ``entry``'s leaves (or those of them given) to its storage: quantize, cast
        (the storage catalogue's ``apply``); nothing for weights kept as they are."""
        self._store(storage_format(entry.storage), entry.leaves if leaves is None else leaves)

    def store_all(self) -> None:
        """:meth:`store` for every entry, one catalogue ``apply`` per storage (a model whose
        weights are all in memory: ``FitPlan.apply``; a format's ``apply`` walks the model)."""
        for storage in storage_formats():
            self._store(storage, [leaf for e in self.plan.entries if e.storage == storage.name for leaf in e.leaves])

    def _store(self, storage: StorageFormat, leaves: Sequence[str]) -> None:
        if storage.decodes and leaves:
            storage.apply(self.model, frozenset(leaves))

    def place(self, entry: PlanEntry, mapped: Sequence[MappedRegions] = ()) -> None:
        """Put ``entry``'s unit where the plan says: kept on the device, or offloaded to CPU
        memory or disk (``mapped``: the checkpoint's files its tensors are views of already,
        a unit on disk computed from them in place). The rest of the model goes to the
        device, but for what the offloaded units hold."""
        if entry.kind == "rest":
            move_kept(self.model, self.offloaded, self.device)
        elif entry.placement == "device":
            for name in entry.modules:
                move_kept(self.model.get_submodule(name), set(), self.device)
        elif mapped:
            for name in entry.modules:
                offload_in_place(self.model.get_submodule(name), self.device, list(mapped))
        elif len(entry.modules) > 1:
            self._offload_tied(entry)
        else:
            offload_units(self.model, [entry], self.device)

    def _offload_tied(self, entry: PlanEntry) -> None:
        """Offload a unit of tied weights together with every other one of its placement
        whose weights are in memory (all of them in ``FitPlan.apply``): one call over their
        common parent, which a second call would find hooked already."""
        if entry.module in self._tied_done:
            return
        group = [
            other
            for other in self.plan.entries
            if len(other.modules) > 1
            and other.placement == entry.placement
            and other.module not in self._tied_done
            and (other is entry or not _on_meta(self.model, other))
        ]
        offload_units(self.model, group, self.device)
        self._tied_done.update(other.module for other in group)

    def finish(self) -> None:
        """Link every offloaded unit into one prefetch schedule, and wrap the hinted modules'
        forward in ``tightfit.hint(...)``. A plan without a rest entry (every tensor in a
        unit) moves nothing else to the device; this moves what its units' leaves hold
        outside their weights (quantizing replaced them)."""
        if not any(entry.kind == "rest" for entry in self.plan.entries):
            move_kept(self.model, self.offloaded, self.device)
        link_offloading(self.model)
        if self.plan.hints:
            add_hints(self.model, self.plan.hints)


def offload_units(model: nn.Module, entries: Sequence[PlanEntry], device: torch.device) -> None:
    """Offload ``entries``' units of ``model`` (one placement) in one call. One module is a
    call over it; units of tied weights are one call over their modules' common parent whose
    granularity picks them: the modules sharing a weight share one stored copy, which each
    one's forward brings onto the device."""
    names = [name for entry in entries for name in entry.modules]
    placement = entries[0].placement
    if len(names) == 1:
        apply_offloading(model.get_submodule(names[0]), device, offload_to=placement, granularity="model")
        return
    parts = [name.split(".") for name in names]
    common = next((i for i, level in enumerate(zip(*parts)) if len(set(level)) > 1), min(map(len, parts)))
    parent = ".".join(parts[0][:common])
    picked = {name.removeprefix(f"{parent}.") if parent else name for name in names}
    apply_offloading(
        model.get_submodule(parent), device, offload_to=placement, granularity=lambda name, _: name in picked
    )


def move_kept(model: nn.Module, offloaded: set[str], device: torch.device) -> None:
    """Move every tensor outside the offloaded units onto ``device`` (a no-op where they
    are). Offloaded units (and every module an offloading hook handles: a tied unit's other
    modules) stay in their storage; the tensors their layers hold outside parameters and
    buffers (quantization scales and maps, which offloading does not move) go to the
    device, where their forward decodes."""
    hooked = {name for name, module in model.named_modules() if (r := HookRegistry.get(module)) and OFFLOADING in r}
    offloaded = set(offloaded) | hooked
    for name, module in model.named_modules():
        if any(name == unit or name.startswith(f"{unit}.") for unit in offloaded):
            move_unregistered(module, device)
            continue
        module._apply(lambda tensor: tensor.to(device), recurse=False)


def _on_meta(model: nn.Module, entry: PlanEntry) -> bool:
    """Whether a tensor of ``entry``'s modules is still on meta (not read in yet)."""
    modules = [model.get_submodule(name) for name in entry.modules]
    return any(t.is_meta for module in modules for t in [*module.parameters(), *module.buffers()])
