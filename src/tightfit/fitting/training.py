"""``fit(..., training=True)``: a training step (forward, backward, optimizer step) within a
byte budget. Per layer of the stack the plan keeps its activations or recomputes them in
the backward (activation checkpointing; on an accelerator it may also offload them to host
memory); it picks the optimizer state's form (8-bit or 32-bit, on the device or paged in
host memory) and the storage of frozen weights (a QLoRA base in NF4, int8, ...), at the
least predicted time. See docs/training.md.

How the peak is predicted: the step is simulated on fake tensors
(:func:`tightfit.memory.simulate.simulate_eager`, the tracker that measures real runs)
with the chosen layers' hooks in place (:mod:`tightfit.hooks.activations`): its activations
and gradients, alive as eager PyTorch keeps them. On top come the weights as stored (the
storage catalogue's bytes) and the optimizer state the step keeps between steps. The search
prices compact frozen weights by the catalogue's decode bytes; the plan it picks is then
simulated again on a fake skeleton converted to its storages, whose backward decodes them
as the real one does, and searched again below the budget by any excess. Recomputing layer
``i`` happens in the backward when the layers after it are gone, so the candidates are the
first ``k`` layers recomputed (or offloaded), ``k`` from 0 up; the peak is not monotonic in
``k`` (recomputing the last layers adds their activations at the backward's start), and
each candidate is simulated, not interpolated.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from tightfit._format import human_bytes
from tightfit._validate import check_choice
from tightfit.backends.registry import shares_host_memory
from tightfit.fitting.allow import Allow
from tightfit.fitting.calibration import Calibration
from tightfit.fitting.options import Option, Unit, find_units, layer_names, options_for
from tightfit.fitting.plan import PlanEntry
from tightfit.fitting.search import Choice, search
from tightfit.fitting.training_plan import OPTIMIZERS, TrainingPlan
from tightfit.hooks.activations import activation_policies, apply_activation_policy

__all__ = ["fit_training"]

#: Forward + backward of a layer that trains: the backward computes two products per weight.
_BACKWARD_FACTOR = 3
#: Most recompute counts simulated per plan: 0, then evenly spaced up to the whole stack.
_MOST_CANDIDATES = 13
#: What a policy does to a layer's activations, in words.
_DONE = {"recompute": "recomputed", "offload": "offloaded to host memory"}
#: Relative difference below which two predicted costs are one (sums taken in other orders).
_SAME = 1e-9
#: Searches, each below the last by what converting the frozen weights needed beyond its price.
_VERIFICATIONS = 4


@dataclass(frozen=True)
class _StateForm:
    """One form of the optimizer state: bits, paged, and what it costs."""

    bits: int
    paged: bool
    device_bytes: int  # held on the device between steps (paged: the two largest parameters' copies in a step)
    total_bytes: int  # wherever it lives
    seconds: float  # the step's predicted seconds


@dataclass(frozen=True)
class _Candidate:
    recomputed: int  # the first k layers
    policy: str  # "recompute" or "offload"
    state: _StateForm
    choice: Choice
    options: list[list[Option]]  # per unit, what the choice picks from
    activation_bytes: int  # simulated forward + backward: activations, gradients, inputs
    seconds: float
    cost: float  # what the choice minimizes: seconds, 8-bit state never cheaper than 32-bit
    fits: bool

    @property
    def peak_bytes(self) -> int:
        return self.choice.peak_bytes


def _frozen_only(unit: Unit, training: set[str]) -> Unit:
    """``unit`` with its training leaves out of the storage choice: their weights stay as they
    are (counted with the unit's other tensors), so storages apply to frozen leaves only."""
    moving = [w for w in unit.weights if w[0] in training]
    if not moving:
        return unit
    moved = sum(math.prod(shape) * dtype.itemsize for _, _, shape, dtype in moving)
    return replace(
        unit,
        weights=tuple(w for w in unit.weights if w[0] not in training),
        other_bytes=unit.other_bytes + moved,
    )


def _state_forms(
    rule: str, params: list[nn.Parameter], device: torch.device, figures: Calibration, min_8bit_size: int
) -> list[_StateForm]:
    """The optimizer state's forms this device offers: 32-bit and 8-bit on the device; paged
    (host memory, brought in per parameter) where the device's memory is not the host's. A step is
    priced by the calibration's AdamW step per value where measured, else by the bytes a
    32-bit step moves, 8-bit too (its coding work is then unmeasured: never counted cheaper)."""
    from tightfit.ops.optimizer import TWO_STATE_OPTIMIZERS
    from tightfit.optim.state import MAP_BYTES, is_8bit, planned_state_bytes

    forms = []
    measured = figures.optimizer_seconds
    # without AdamW's measured step: the bytes a 32-bit step reads and writes (an 8-bit step's coding is unmeasured)
    moved = sum(p.numel() * p.element_size() * 3 + 2 * planned_state_bytes(rule, p, False) for p in params)
    for bits in (32, 8):
        eight_bit = [is_8bit(bits, min_8bit_size, p) for p in params]
        sizes = [planned_state_bytes(rule, p, eight) for p, eight in zip(params, eight_bit)]
        maps = (2 if rule in TWO_STATE_OPTIMIZERS else 1) * MAP_BYTES if any(eight_bit) else 0
        if set(measured) == {"8", "32"}:
            seconds = sum(p.numel() * measured["8" if eight else "32"] for p, eight in zip(params, eight_bit))
        else:
            seconds = moved / figures.device_bandwidth
        forms.append(_StateForm(bits, False, sum(sizes) + maps, sum(sizes) + maps, seconds))
        if not shares_host_memory(device) and figures.host_to_device_bandwidth is not None:
            two_largest = sum(sorted(sizes, reverse=True)[:2])
            paged_seconds = seconds + 2 * sum(sizes) / figures.host_to_device_bandwidth
            forms.append(_StateForm(bits, True, two_largest + maps, sum(sizes) + maps, paged_seconds))
    return forms


def _recompute_counts(layers: int) -> list[int]:
    if layers + 1 <= _MOST_CANDIDATES:
        return list(range(layers + 1))
    return sorted({round(i * layers / (_MOST_CANDIDATES - 1)) for i in range(_MOST_CANDIDATES)})


def _skeleton(model: nn.Module, device: torch.device, mode: Any) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fakes of ``mode`` on ``device``
    (nothing real is copied: weights tied stay tied), for a storage to convert under ``mode``."""
    tensors = [*model.parameters(), *model.buffers()]
    with mode:
        memo = {}
        for t in tensors:
            fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


@dataclass
class _Step:
    """A training step of one model as the planner simulates and prices it."""

    model: nn.Module
    args: tuple
    kwargs: dict
    device: torch.device
    figures: Calibration
    whole_units: list[Unit]  # the model's units, training leaves included
    training_leaves: set[str]
    layers: list[str]
    rows: dict[str, int]
    call_rows: dict[str, int]
    storages: frozenset[str]
    forms: list[_StateForm]
    simulated: dict[tuple, tuple[int, str | None]] = field(default_factory=dict)
    units: list[Unit] = field(init=False)  # the units as the storage choice sees them: frozen leaves only
    forward: dict[str, float] = field(init=False)  # per unit, its forward with every weight kept
    trained_seconds: float = field(init=False)  # the training leaves' forwards: their storage never changes

    def __post_init__(self) -> None:
        self.units = [_frozen_only(unit, self.training_leaves) for unit in self.whole_units]
        self.forward = {unit.name: self._keep_seconds(unit) for unit in self.whole_units}
        self.trained_seconds = sum(self.forward.values()) - sum(self._keep_seconds(unit) for unit in self.units)

    def simulate(
        self, count: int, policy: str, stored: tuple[tuple[str, frozenset[str]], ...] = ()
    ) -> tuple[int, str | None]:
        """Bytes alive at the simulated forward + backward's peak (activations, gradients,
        inputs) with the first ``count`` layers under ``policy``, and the op it is at;
        ``stored``: (storage, leaves) converted first, in a fake skeleton of the model."""
        key = (count, policy if count else "keep", stored)
        if key not in self.simulated:
            self.simulated[key] = self._simulate({name: policy for name in self.layers[:count]}, stored)
        return self.simulated[key]

    def _simulate(self, policies: dict[str, str], stored: tuple) -> tuple[int, str | None]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from tightfit.memory.simulate import simulate_eager
        from tightfit.quant import storage_format

        mode, model = None, self.model
        if stored:  # the tables a conversion reads are real constants: the mode takes them in
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            model = _skeleton(self.model, self.device, mode)
            with mode:
                for name, leaves in stored:
                    storage_format(name).apply(model, leaves)
        before = activation_policies(model)
        apply_activation_policy(model, policies, planning=True)  # simulated on the plan's device, wherever it sits
        try:
            timeline = simulate_eager(model, self.args, self.kwargs, device=self.device, training=True, mode=mode)
        finally:
            apply_activation_policy(model, {name: before.get(name, "keep") for name in policies}, planning=True)
        key = str(self.device)
        live, inputs = timeline.live_bytes(key), timeline.inputs.get(key, 0)
        if not live:
            return inputs, None
        top = max(range(len(live)), key=live.__getitem__)
        return live[top] + inputs, timeline.steps[top]

    def options(self, held_above: int) -> list[list[Option]]:
        """Each unit's storages on the device; a frozen weight decodes on top of what the step holds."""
        live = dict.fromkeys(self.rows, held_above)
        return [
            options_for(
                unit,
                storages=self.storages,
                placements=frozenset({"device"}),
                device=self.device,
                rows=self.rows,
                call_rows=self.call_rows,
                live=live,
                figures=self.figures,
            )
            for unit in self.units
        ]

    def price(self, count: int, policy: str, form: _StateForm, budget: int) -> _Candidate:
        """The fastest storages for the frozen weights with ``count`` layers under
        ``policy`` and the state in ``form``, within ``budget`` where any are."""
        active, _ = self.simulate(count, policy)
        options = self.options(active + form.device_bytes)
        found = search(options, budget, active + form.device_bytes)
        choice = found.best if found.best is not None else found.smallest
        extra = self.recompute_seconds(count) if policy == "recompute" else self.offload_seconds(count, active)
        weights = _BACKWARD_FACTOR * (choice.seconds + self.trained_seconds) + extra
        # state loses precision only to meet the budget: 8-bit never counts as faster than 32-bit where both live
        precise = next(f.seconds for f in self.forms if f.bits == 32 and f.paged == form.paged)
        return _Candidate(
            count,
            policy,
            form,
            choice,
            options,
            active,
            weights + form.seconds,
            weights + max(form.seconds, precise),
            found.best is not None,
        )

    def recompute_seconds(self, count: int) -> float:
        """The forwards of the first ``count`` layers, run again in the backward."""
        return sum(self.forward.get(name, 0.0) for name in self.layers[:count])

    def offload_seconds(self, count: int, active: int | None = None) -> float:
        """Copying what the first ``count`` layers save to host memory and back (0 where
        ``active``, the simulated peak with them offloaded, is not given: a lower bound)."""
        if not count or active is None:
            return 0.0
        return 2 * max(0, self.simulate(0, "keep")[0] - active) / self.figures.host_to_device_bandwidth

    def _keep_seconds(self, unit: Unit) -> float:
        """``unit``'s forward with its weights as they are."""
        options = options_for(
            unit,
            storages=frozenset({"keep"}),
            placements=frozenset({"device"}),
            device=self.device,
            rows=self.rows,
            call_rows=self.call_rows,
            live={},
            figures=self.figures,
        )
        return options[0].seconds

    def verified(self, candidate: _Candidate) -> _Candidate:
        """``candidate`` with its forward and backward simulated as converted: the frozen
        weights in their chosen storages (a decoded weight in the backward is in it)."""
        picks: dict[str, set[str]] = {}
        for unit, unit_options, pick in zip(self.units, candidate.options, candidate.choice.picks):
            storage = unit_options[pick].storage
            if storage != "keep" and unit.weights:
                picks.setdefault(storage, set()).update(name for name, *_ in unit.weights)
        stored = tuple(sorted((name, frozenset(leaves)) for name, leaves in picks.items()))
        if not stored:
            return candidate
        active, _ = self.simulate(candidate.recomputed, candidate.policy, stored)
        choice = replace(candidate.choice, active_bytes=active + candidate.state.device_bytes, compute_bytes=0)
        return replace(candidate, choice=choice, activation_bytes=active)


def fit_training(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    budget_bytes: int,
    *,
    resolved: Any,
    figures: Calibration,
    allowed: Allow,
    optimizer: str,
    fit_error: Callable[..., Exception],
) -> TrainingPlan:
    """The training plan (see the module doc); ``fit_error(message, budget_bytes=,
    smallest_peak_bytes=, parts=)`` makes the error raised when nothing fits."""
    from tightfit.fitting.traced import trace_forward
    from tightfit.optim.rules import MIN_8BIT_SIZE

    check_choice("optimizer", optimizer, tuple(OPTIMIZERS))
    backends, device = resolved
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            f"training=True, but no parameter of {type(model).__name__} requires grad: nothing would train "
            f"(set requires_grad on the weights or adapters to train)"
        )
    training_leaves = {
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.requires_grad
    }
    _, leaves = trace_forward(model, args, kwargs, resolved)  # rows per leaf: what each unit's time scales with
    step = _Step(
        model=model,
        args=args,
        kwargs=kwargs,
        device=device,
        figures=figures,
        whole_units=find_units(model, None, "layers"),
        training_leaves=training_leaves,
        layers=list(layer_names(model)),
        rows=leaves.rows,
        call_rows=leaves.call_rows,
        storages=frozenset(name for name in allowed.storage if name in training_storages()),
        forms=_state_forms(OPTIMIZERS[optimizer], params, device, figures, MIN_8BIT_SIZE),
    )
    search_budget = budget_bytes
    best = smallest = None
    for _ in range(_VERIFICATIONS):
        best, smallest = _best(step, search_budget)
        if best is None:
            break
        best = step.verified(best)
        if best.peak_bytes <= budget_bytes:
            break
        search_budget -= best.peak_bytes - budget_bytes  # converting needed more than priced: search below
        best = None
    full = step.price(0, "keep", next(f for f in step.forms if f.bits == 32 and not f.paged), budget_bytes)
    if best is None:
        smallest = step.verified(smallest)  # the error names a peak simulated as converted
        parts = _parts(smallest)
        listed = "; ".join(f"{what}: {human_bytes(size)}" for what, size in parts[:4])
        layers = (
            f"the first {smallest.recomputed} of {len(step.layers)} layers' activations {_DONE[smallest.policy]}"
            if smallest.recomputed
            else "every layer's activations kept"
        )
        raise fit_error(
            f"budget={human_bytes(budget_bytes)} ({budget_bytes} B) cannot be met on {device} for a training step: "
            f"the smallest predicted peak is {human_bytes(smallest.peak_bytes)} ({smallest.peak_bytes} B) "
            f"({layers}, {smallest.state.bits}-bit optimizer state{' paged' if smallest.state.paged else ''}, frozen "
            f"weights in the smallest storage allowed), dominated by {parts[0][0]}. Largest parts: {listed}",
            budget_bytes=budget_bytes,
            smallest_peak_bytes=smallest.peak_bytes,
            parts=parts,
        )
    return _plan(step, backends[0].name, budget_bytes, best, full, optimizer)


def _best(step: _Step, budget: int) -> tuple[_Candidate | None, _Candidate]:
    """The least-cost candidate within ``budget`` (None where none is) and the least-peak
    one, over the recompute (or offload) counts, from none up, and the state's forms."""
    policies = ["recompute"] if shares_host_memory(step.device) else ["offload", "recompute"]
    best: _Candidate | None = None
    smallest: _Candidate | None = None
    # the least any candidate with k layers recomputed can cost: each unit's fastest storage, 32-bit state
    fastest = sum(min(o.seconds for o in options) for options in step.options(0)) + step.trained_seconds
    floor = _BACKWARD_FACTOR * fastest + min(f.seconds for f in step.forms if f.bits == 32)
    for count in _recompute_counts(len(step.layers)):
        least = floor + min(
            step.recompute_seconds(count), step.offload_seconds(count) if len(policies) > 1 else math.inf
        )
        if best is not None and best.cost <= least * (1 + _SAME):
            break  # nothing with more layers recomputed can be cheaper
        for policy in policies if count else ["keep"]:
            for form in step.forms:
                candidate = step.price(count, policy, form, budget)
                if smallest is None or candidate.peak_bytes < smallest.peak_bytes:
                    smallest = candidate
                if candidate.fits and (best is None or candidate.cost < best.cost):
                    best = candidate
    return best, smallest


def training_storages() -> tuple[str, ...]:
    """The storages a training plan may give frozen weights: those that keep a weight's
    codes for the backward and decode them again there. A storage that casts in place
    (bfloat16, float8) is upcast for each forward and autograd keeps that copy for the
    backward, more than the weight it replaced; one with an outlier path (int8) holds
    bytes that depend on the data."""
    from tightfit.quant import storage_formats

    return tuple(f.name for f in storage_formats() if not f.casts and f.outlier_threshold is None)


def _parts(candidate: _Candidate) -> list[tuple[str, int]]:
    """(what, bytes) of a candidate's peak, largest first."""
    state = candidate.state
    parts = [
        ("activations, gradients and inputs of the forward and backward", candidate.activation_bytes),
        ("weights as stored", candidate.choice.held_bytes),
        (
            f"{state.bits}-bit optimizer state{' (paged: two parameters at a time)' if state.paged else ''}",
            state.device_bytes,
        ),
    ]
    decoded = candidate.peak_bytes - sum(size for _, size in parts)
    if decoded > 0:
        parts.append(("a frozen weight decoded while it computes", decoded))
    return sorted(parts, key=lambda part: -part[1])


def _plan(
    step: _Step, backend: str, budget_bytes: int, best: _Candidate, full: _Candidate, optimizer: str
) -> TrainingPlan:
    entries = []
    for unit, options, pick in zip(step.units, best.options, best.choice.picks):
        option = options[pick]
        keep = next(o for o in options if o.storage == "keep")
        if option.storage != "keep":
            why = f"{option.storage} (frozen): {human_bytes(keep.held_bytes - option.held_bytes)} less on the device"
        elif unit.weights:
            why = "kept: fastest, and the budget has room"
        else:
            why = "kept: nothing in it to store otherwise (its weights train, or it has none)"
        entries.append(
            PlanEntry(
                module=unit.name,
                kind=unit.kind,
                storage=option.storage,
                placement="device",
                bytes_before=unit.bytes,
                bytes_after=option.stored_bytes,
                held_bytes=option.held_bytes,
                seconds=option.seconds,
                why=why,
                leaves=tuple(name for name, *_ in unit.weights),
            )
        )
    _, peak_node = step.simulate(best.recomputed, best.policy)
    return TrainingPlan(
        model=type(step.model).__name__,
        backend=backend,
        device=str(step.device),
        budget_bytes=budget_bytes,
        optimizer=optimizer,
        optim_bits=best.state.bits,
        paged=best.state.paged,
        activations={name: best.policy for name in step.layers[: best.recomputed]},
        entries=tuple(entries),
        predicted_peak_bytes=best.peak_bytes,
        predicted_weights_bytes=best.choice.held_bytes,
        predicted_activation_bytes=best.activation_bytes,
        predicted_state_bytes=best.state.device_bytes,
        state_bytes=best.state.total_bytes,
        predicted_seconds=best.seconds,
        full_peak_bytes=full.peak_bytes,
        full_seconds=full.seconds,
        peak_node=peak_node,
        layers=tuple(step.layers),
    )
