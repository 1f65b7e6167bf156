"""The :class:`TrainingPlan` that ``tightfit.fit(..., training=True)`` returns: per layer what
its activations do, the optimizer state's form, the frozen weights' storage, with the
predicted peak of a training step; ``apply`` carries it out, ``make_optimizer`` makes the
optimizer it planned, ``print`` shows it, JSON keeps it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tightfit._format import human_bytes
from tightfit._validate import check_type
from tightfit.fitting.execute import PlanExecutor, move_kept
from tightfit.fitting.plan import PlanEntry, _check_bytes, _check_seconds, _check_str, plan_dict, read_plan_json
from tightfit.hooks.activations import ACTIVATION_POLICIES, apply_activation_policy

__all__ = ["OPTIMIZERS", "TrainingPlan"]

_FORMAT = "tightfit.training-plan/1"

#: The optimizers a training plan sizes (the classes of :mod:`tightfit.optim`, by name) and
#: the update rule each keeps state for.
OPTIMIZERS = {
    "Adam": "adam",
    "AdamW": "adam",
    "AdEMAMix": "ademamix",
    "Lion": "lion",
    "SGD": "momentum",
    "RMSprop": "rmsprop",
    "Adagrad": "adagrad",
    "LAMB": "adam",
    "LARS": "momentum",
}


@dataclass(frozen=True)
class TrainingPlan:
    """What fits for one training step (forward, backward, optimizer step).

    ``predicted_peak_bytes`` = ``predicted_weights_bytes`` (as stored) +
    ``predicted_activation_bytes`` (the simulated forward and backward's peak: activations,
    gradients, inputs) + ``predicted_state_bytes`` (optimizer state on the device between
    steps; paged: the two largest parameters' copies during the step) + any decoded tile of
    a frozen weight. ``activations``: layer -> ``"recompute"`` or ``"offload"`` (the layers
    not named keep theirs); ``optimizer``, ``optim_bits``, ``paged``: the optimizer
    :meth:`make_optimizer` makes; ``state_bytes``: its state wherever it lives. ``full_peak_bytes``:
    the unplanned step (everything kept, 32-bit state on the device). ``predicted_seconds``:
    the time model's step (forward and backward at three times the forward's weight work,
    recomputed forwards, offload copies, the optimizer's bytes); it ranks plans.
    """

    model: str
    backend: str
    device: str
    budget_bytes: int
    optimizer: str
    optim_bits: int
    paged: bool
    activations: dict[str, str]
    entries: tuple[PlanEntry, ...]
    predicted_peak_bytes: int
    predicted_weights_bytes: int
    predicted_activation_bytes: int
    predicted_state_bytes: int
    state_bytes: int
    predicted_seconds: float
    full_peak_bytes: int
    full_seconds: float
    peak_node: str | None = None
    layers: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("model", "backend", "device"):
            _check_str("TrainingPlan", name, getattr(self, name))
        check_type("TrainingPlan.layers", self.layers, (tuple, list))
        object.__setattr__(self, "layers", tuple(self.layers))  # JSON holds a list
        if not isinstance(self.optimizer, str) or self.optimizer not in OPTIMIZERS:
            raise ValueError(f"TrainingPlan.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if isinstance(self.optim_bits, bool) or not isinstance(self.optim_bits, int) or self.optim_bits not in (8, 32):
            raise ValueError(f"TrainingPlan.optim_bits must be 8 or 32, got {self.optim_bits!r}")
        if self.peak_node is not None:
            _check_str("TrainingPlan", "peak_node", self.peak_node)
        for layer in self.layers:
            check_type("TrainingPlan.layers item", layer, str)
        check_type("TrainingPlan.paged", self.paged, bool)
        check_type("TrainingPlan.activations", self.activations, dict)
        for name, policy in self.activations.items():
            check_type("TrainingPlan.activations key", name, str)
            if policy not in ACTIVATION_POLICIES[1:]:
                raise ValueError(
                    f"TrainingPlan.activations[{name!r}] must be one of {', '.join(ACTIVATION_POLICIES[1:])}, "
                    f"got {policy!r}"
                )
            if policy == "offload" and self.device == "cpu":
                raise ValueError(
                    f"TrainingPlan.activations[{name!r}] is 'offload', but the plan is for the CPU, whose memory is "
                    f"host memory; offload is for a plan on an accelerator"
                )
        for entry in self.entries:
            check_type("TrainingPlan.entries item", entry, PlanEntry)
        for name in (
            "budget_bytes",
            "predicted_peak_bytes",
            "predicted_weights_bytes",
            "predicted_activation_bytes",
            "predicted_state_bytes",
            "state_bytes",
            "full_peak_bytes",
        ):
            _check_bytes("TrainingPlan", name, getattr(self, name))
        for name in ("predicted_seconds", "full_seconds"):
            _check_seconds("TrainingPlan", name, getattr(self, name))

    # -- carrying it out ------------------------------------------------------------------
    def apply(self, model: nn.Module) -> nn.Module:
        """Carry the plan out on ``model``, in place: each frozen weight stored as planned
        (the storage catalogue's format quantizes or casts it), the model moved to the
        plan's device, each named layer's activation hook registered
        (:func:`~tightfit.hooks.activations.apply_activation_policy`; ``remove_activation_policy``
        undoes it). Returns ``model``."""
        check_type("model", model, nn.Module)
        modules = dict(model.named_modules())
        decided = [*self.activations, *(e.module for e in self.entries if e.kind != "rest")]
        missing = [name for name in decided if name not in modules]
        if missing:
            raise ValueError(
                f"model has no module {missing[0]!r}, which this plan decides for; apply a plan to the model it was "
                f"made for ({self.model})"
            )
        on_meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
        if on_meta is not None:
            raise ValueError(f"model's {on_meta!r} is on the meta device: apply needs real weights; load them first")
        PlanExecutor(model, self, torch.device(self.device)).store_all()
        move_kept(model, set(), torch.device(self.device))
        apply_activation_policy(model, self.activations)
        return model

    def make_optimizer(self, params: Any, **settings: Any) -> torch.optim.Optimizer:
        """The planned optimizer over ``params`` (``model.parameters()``: those that do not
        require grad are left out), with the planned ``optim_bits`` and ``paged``; ``settings``:
        the rest of its arguments (``lr``, ``betas``, ``weight_decay``, ...)."""
        import tightfit.optim

        for name in ("optim_bits", "paged"):
            if name in settings:
                raise TypeError(f"{name} is the plan's ({getattr(self, name)!r}); it is not a setting to give")
        trainable = [p for p in params if not isinstance(p, torch.Tensor) or p.requires_grad]
        kind = getattr(tightfit.optim, self.optimizer)
        return kind(trainable, optim_bits=self.optim_bits, paged=self.paged, **settings)

    # -- report ---------------------------------------------------------------------------
    def changed_entries(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.changed)

    def __str__(self) -> str:
        recomputed = [name for name, policy in self.activations.items() if policy == "recompute"]
        offloaded = [name for name, policy in self.activations.items() if policy == "offload"]
        lines = [
            f"training plan: {self.model} on {self.device} (backend {self.backend}), budget "
            f"{human_bytes(self.budget_bytes)} ({self.budget_bytes} B)",
            f"predicted step peak {human_bytes(self.predicted_peak_bytes)} = weights "
            f"{human_bytes(self.predicted_weights_bytes)} + forward/backward {human_bytes(self.predicted_activation_bytes)}"
            f" + optimizer state {human_bytes(self.predicted_state_bytes)}"
            f"; unplanned step {human_bytes(self.full_peak_bytes)}",
            f"optimizer: {self.optimizer}, {self.optim_bits}-bit state{', paged in host memory' if self.paged else ''} "
            f"({human_bytes(self.state_bytes)} in all)",
            f"activations: {len(self.layers) - len(self.activations)} of {len(self.layers)} layers kept"
            + (f"; recomputed: {_names(recomputed)}" if recomputed else "")
            + (f"; offloaded to host memory: {_names(offloaded)}" if offloaded else ""),
            f"time model, one step (ranks plans; not a latency) {self.predicted_seconds * 1e3:.2f} ms "
            f"(unplanned {self.full_seconds * 1e3:.2f} ms)",
        ]
        for entry in self.changed_entries():
            lines.append(f"  {entry.module}: {entry.why}")
        return "\n".join(lines)

    # -- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return plan_dict(self, _FORMAT) | {"layers": list(self.layers)}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> TrainingPlan:
        """The plan ``to_json`` wrote."""
        return read_plan_json(cls, text, _FORMAT, "training plan")


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])} ... {names[-1]} ({len(names)})"
