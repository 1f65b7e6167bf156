"""The :class:`FitPlan` that ``tightfit.fit`` returns: per unit, how it is stored and
where, with the predicted peak and time; ``apply`` carries it out (each storage as its
format in the storage catalogue applies it), ``print`` shows it, JSON keeps it.

``Plan``, its name before, still works for one release with a DeprecationWarning."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

import tightfit.graph
from tightfit._deprecation import renamed
from tightfit._files import parse_json
from tightfit._validate import check_count, check_type
from tightfit.fitting.execute import PlanExecutor
from tightfit.fitting.options import PLACEMENTS, TIED_DECODE, storage_names
from tightfit.fitting.quality import parse_error
from tightfit.fitting.regions import check_module_hints
from tightfit.fitting.table import render
from tightfit.quant import storage_format

__all__ = ["FitPlan", "PlanEntry"]

_FORMAT = "tightfit.plan/1"
_KINDS = ("layer", "block", "expert", "linear", "embedding", "rest")
#: How a plan's prediction runs the model: op by op (``eager``), or as
#: ``torch.compile(model, backend=tightfit.graph.compiler(execution="fx"))`` runs it (``compiled``).
_RUNTIMES = ("eager", "compiled")


def _check_str(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, got {type(value).__name__}: {value!r}")


def _check_bytes(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}.{name} must be an int >= 0 (bytes), got {value!r}")


def _check_seconds(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{owner}.{name} must be a finite number >= 0 (seconds), got {value!r}")


@dataclass(frozen=True)
class PlanEntry:
    """The decision for one unit (a layer of the stack, or a block or an expert of one; a
    Linear or Embedding; or the rest).

    ``leaves``: the Linear / Embedding modules whose weights ``storage`` applies to;
    ``bytes_before`` / ``bytes_after``: the unit's tensors as they are and as planned;
    ``held_bytes``: what stays in the device's memory between forwards; ``seconds``: its
    predicted share of one forward; ``why``: the reason, in words.

    Tied weights (modules outside the layer stack sharing a weight, such as GPT-2's
    ``transformer.wte`` and ``lm_head``) are one unit: ``module`` is the first of them and
    ``leaves`` lists all of them, so a leaf outside ``module`` is another module of the
    unit (:attr:`modules`). Such a unit is stored as it is (``keep``), wherever it is placed.
    """

    module: str
    kind: str
    storage: str
    placement: str
    bytes_before: int
    bytes_after: int
    held_bytes: int
    seconds: float
    why: str
    leaves: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("module", "kind", "storage", "placement", "why"):
            _check_str("PlanEntry", name, getattr(self, name))
        if self.kind not in _KINDS:
            raise ValueError(f"PlanEntry.kind={self.kind!r} is not accepted; accepted: {', '.join(_KINDS)}")
        if self.storage not in storage_names():
            raise ValueError(
                f"PlanEntry.storage={self.storage!r} is not accepted; accepted: {', '.join(storage_names())}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"PlanEntry.placement={self.placement!r} is not accepted; accepted: {', '.join(PLACEMENTS)}"
            )
        for name in ("bytes_before", "bytes_after", "held_bytes"):
            _check_bytes("PlanEntry", name, getattr(self, name))
        _check_seconds("PlanEntry", "seconds", self.seconds)
        if not isinstance(self.leaves, (tuple, list)) or not all(isinstance(leaf, str) for leaf in self.leaves):
            raise TypeError(f"PlanEntry.leaves must be a tuple of str (module names), got {self.leaves!r}")
        object.__setattr__(self, "leaves", tuple(self.leaves))
        if len(self.modules) > 1 and storage_format(self.storage).decodes:
            raise ValueError(
                f"PlanEntry.storage={self.storage!r} for tied weights ({', '.join(self.modules)}): {TIED_DECODE}; "
                f"accepted: 'keep'"
            )

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules this unit covers: ``module``, and the leaves outside it (tied
        weights); none for the rest."""
        if self.kind == "rest":
            return ()
        others = [leaf for leaf in self.leaves if leaf != self.module and not leaf.startswith(f"{self.module}.")]
        return (self.module, *others)

    @property
    def changed(self) -> bool:
        return self.storage != "keep" or self.placement != "device"


@dataclass(frozen=True)
class FitPlan:
    """What fits: per-unit decisions and the predicted device peak and time per forward.

    ``predicted_peak_bytes`` = ``predicted_weights_bytes`` (held on the device) +
    ``predicted_activation_bytes`` (planned activations and inputs) +
    ``predicted_transient_bytes`` (decoded weights above the activation peak, onloaded
    copies of offloaded units).
    ``full_peak_bytes``: what the unchanged model needs; ``applies_nothing``: the budget
    covers that, so ``apply`` leaves the model as it is. ``int8_outliers``: whether the
    int8 units' LLM.int8() outlier columns were observed or assumed.

    ``hints``: module name -> the ``tightfit.hint`` keywords ``apply`` wraps its forward
    in (DFS slicing of the layer stack); ``runtime``: what the prediction assumes,
    ``"eager"`` or ``"compiled"``. A plan with hints is ``"compiled"``: in eager mode
    hints are no-ops, so its predicted peak holds only for the model
    :meth:`compile` returns (the tightfit backend with FX execution).

    ``covers_load``: the prediction covers streaming the weights in from a checkpoint
    (:func:`tightfit.load`); ``predicted_load_peak_bytes`` is the most held while loading
    (weights held + the largest unit as read and converting), within ``predicted_peak_bytes``.

    ``reserved``: bytes the run holds on the device outside the weights and the planned
    forward, by what they are for (a causal LM's KV cache growing to its context): the
    planner fits the units into the budget less these, and ``predicted_peak_bytes`` and
    ``full_peak_bytes`` count them (:attr:`reserved_bytes`). ``reserved_loading``: bytes
    held only while the checkpoint streams in (a stored-quantized unit's entries checked
    as it loads), counted in ``predicted_load_peak_bytes`` above each unit as it loads.

    ``predicted_error``: the plan's expected error (:mod:`tightfit.fitting.quality`);
    ``max_error``: the bound it was planned under; ``quality``: the two in words, and why
    where the budget forced the plan above a default bound. ``decode_steps``: the one-token
    forwards after the traced one that ``predicted_seconds`` and ``full_seconds`` include.

    ``phase_peaks``: the predicted peak of each phase of a generation ("prefill": the traced
    forward; "decode": the last one-token forward, the KV cache at its longest), where the
    last decode step was traced too (``fit(..., decode=...)``); ``predicted_peak_bytes`` is
    the larger. ``kv_cache``: that cache's ``format``, ``context`` (positions) and ``bytes``
    there, inside the decode phase's activations ({} without one). ``disk_reads``: how the
    time model priced the reads of the units on disk ("" where none is), from the page cache
    or from the disk, and why.
    """

    model: str
    backend: str
    device: str
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_weights_bytes: int
    predicted_activation_bytes: int
    predicted_transient_bytes: int
    predicted_seconds: float
    full_peak_bytes: int
    full_seconds: float
    applies_nothing: bool
    entries: tuple[PlanEntry, ...]
    peak_node: str | None = None
    allow: dict[str, list[str]] | None = None
    calibration: dict[str, Any] | None = None
    int8_outliers: str = ""  # what the int8 units' prediction assumes about outlier columns ("" without int8 units)
    hints: dict[str, dict[str, Any]] = field(default_factory=dict)
    runtime: str = "eager"
    covers_load: bool = False
    predicted_load_peak_bytes: int = 0
    reserved: dict[str, int] = field(default_factory=dict)
    reserved_loading: dict[str, int] = field(default_factory=dict)
    predicted_error: float = 0.0
    max_error: float | None = None
    quality: str = ""
    decode_steps: int = 0
    phase_peaks: dict[str, int] = field(default_factory=dict)
    kv_cache: dict[str, Any] = field(default_factory=dict)
    disk_reads: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "backend", "device", "int8_outliers", "quality", "disk_reads"):
            _check_str("FitPlan", name, getattr(self, name))
        for name in (
            "budget_bytes",
            "predicted_peak_bytes",
            "predicted_weights_bytes",
            "predicted_activation_bytes",
            "predicted_transient_bytes",
            "full_peak_bytes",
            "predicted_load_peak_bytes",
        ):
            _check_bytes("FitPlan", name, getattr(self, name))
        for name in ("predicted_seconds", "full_seconds"):
            _check_seconds("FitPlan", name, getattr(self, name))
        check_count("FitPlan.decode_steps", self.decode_steps)
        for name in ("applies_nothing", "covers_load"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"FitPlan.{name} must be a bool, got {type(getattr(self, name)).__name__}: {getattr(self, name)!r}"
                )
        if not isinstance(self.entries, (tuple, list)):
            raise TypeError(f"FitPlan.entries must be a tuple of PlanEntry, got {type(self.entries).__name__}")
        for index, entry in enumerate(self.entries):
            if not isinstance(entry, PlanEntry):
                raise TypeError(f"FitPlan.entries[{index}] must be a PlanEntry, got {type(entry).__name__}: {entry!r}")
        object.__setattr__(self, "entries", tuple(self.entries))
        if self.peak_node is not None:
            _check_str("FitPlan", "peak_node", self.peak_node)
        for name in ("allow", "calibration"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"FitPlan.{name} must be a dict or None, got {type(value).__name__}: {value!r}")
        object.__setattr__(self, "hints", check_module_hints("FitPlan.hints", self.hints))
        object.__setattr__(self, "reserved", check_reserved("FitPlan.reserved", self.reserved))
        object.__setattr__(self, "reserved_loading", check_reserved("FitPlan.reserved_loading", self.reserved_loading))
        object.__setattr__(self, "phase_peaks", _check_phase_peaks(self.phase_peaks))
        object.__setattr__(self, "kv_cache", _check_kv_cache(self.kv_cache))
        object.__setattr__(self, "predicted_error", parse_error(self.predicted_error, "FitPlan.predicted_error"))
        if self.max_error is not None:
            object.__setattr__(self, "max_error", parse_error(self.max_error, "FitPlan.max_error"))
        _check_str("FitPlan", "runtime", self.runtime)
        if self.runtime not in _RUNTIMES:
            raise ValueError(f"FitPlan.runtime={self.runtime!r} is not accepted; accepted: {', '.join(_RUNTIMES)}")
        if self.hints and self.runtime != "compiled":
            raise ValueError(
                f"FitPlan.runtime={self.runtime!r} with hints: hints save memory only when compiled; "
                f"accepted: 'compiled' with hints"
            )

    # -- apply ------------------------------------------------------------------------
    def apply(self, model: nn.Module) -> nn.Module:
        """Carry the plan out on ``model``, in place, unit by unit, as
        :func:`tightfit.load` does while streaming
        (:class:`~tightfit.fitting.execute.PlanExecutor`): each unit stored as planned (its
        format in the storage catalogue applies it: quantizing, casting to float8), then kept
        on the device (moved there: a model loaded on the CPU and planned for an accelerator)
        or offloaded; the offloaded units prefetch one another; the hinted modules' forward
        is wrapped in ``tightfit.hint(...)`` (``tightfit.fitting.remove_hints(model)`` undoes
        that). Returns ``model``. With ``applies_nothing`` it changes nothing.

        Hints are no-ops in eager mode: a plan with hints meets its predicted peak only
        when the model runs as :meth:`compile` returns it."""
        check_type("model", model, nn.Module)
        self._check_matches(model)
        if self.applies_nothing:
            return model

        executor = PlanExecutor(model, self, torch.device(self.device))
        executor.store_all()
        for entry in executor.entries:
            executor.place(entry)
        executor.finish()
        return model

    def compile(self, model: nn.Module) -> nn.Module:
        """``model`` (applied) compiled as this plan's prediction runs it: the tightfit
        backend with FX execution, which carries out the DFS hints; the prediction does
        not describe inductor-compiled splits (``execution="auto"``), which fuse ops."""
        check_type("model", model, nn.Module)

        return torch.compile(model, backend=tightfit.graph.compiler(execution="fx"))

    def _check_matches(self, model: nn.Module) -> None:
        on_meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
        if on_meta is not None:
            raise ValueError(
                f"model's {on_meta!r} is on the meta device: a plan can be made for such a model, "
                f"but apply needs real weights; load them first"
            )
        names = dict(model.named_modules())
        for entry in self.entries:
            if entry.kind == "rest":
                continue
            if entry.module not in names:
                raise ValueError(
                    f"model has no module {entry.module!r}, which this plan decides for; "
                    f"apply a plan to the model it was made for ({self.model})"
                )
            for leaf in entry.leaves:
                if type(names.get(leaf)) not in (nn.Linear, nn.Embedding):
                    raise ValueError(
                        f"model's {leaf!r} is {type(names.get(leaf)).__name__}, not the Linear or Embedding "
                        f"this plan expects; was the plan applied already, or made for another model?"
                    )
        for name in self.hints:
            if name not in names:
                raise ValueError(
                    f"model has no module {name!r}, which this plan hints; "
                    f"apply a plan to the model it was made for ({self.model})"
                )

    # -- report ---------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        """All of :attr:`reserved`: what the units were fitted without."""
        return sum(self.reserved.values())

    def changed_entries(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.changed)

    def __str__(self) -> str:

        return render(self)

    # -- JSON -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return plan_dict(self, _FORMAT)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> FitPlan:
        """The plan ``to_json`` wrote."""
        return read_plan_json(cls, text, _FORMAT, "plan")


def plan_dict(plan: Any, format_name: str) -> dict[str, Any]:
    """A plan dataclass as the dict its JSON holds: its fields, its entries' leaves as lists,
    and ``format`` (what :func:`read_plan_json` checks)."""
    data = asdict(plan)
    data["format"] = format_name
    data["entries"] = [asdict(e) | {"leaves": list(e.leaves)} for e in plan.entries]
    return data


def read_plan_json(cls: type, text: str, expected: str, noun: str) -> Any:
    """A plan of dataclass ``cls`` from the JSON its ``to_json`` wrote (``format`` ``expected``):
    unknown keys, each entry and each field checked, every error naming the ``noun``."""
    check_type("text", text, str)
    data = parse_json(text, "text", what="is not JSON")
    if not isinstance(data, dict) or data.get("format") != expected:
        raise ValueError(f"text is not a tightfit {noun}: expected a JSON object with format {expected!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known - {"format"})
    if unknown:
        raise ValueError(f"{noun} JSON has unknown keys {unknown}; known: {sorted(known)}")
    entries = data.get("entries", [])
    if not isinstance(entries, list):
        raise ValueError(f"{noun} JSON field 'entries' must be a list of objects, got {type(entries).__name__}")
    built = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{noun} JSON field 'entries[{index}]' must be an object, got {type(entry).__name__}")
        try:
            built.append(PlanEntry(**entry))
        except (TypeError, ValueError) as error:  # a key missing or unknown, or a value of the wrong type
            raise ValueError(f"{noun} JSON field 'entries[{index}]' does not describe a plan entry: {error}") from None
    try:
        return cls(
            **{key: value for key, value in data.items() if key in known and key != "entries"}, entries=tuple(built)
        )
    except (TypeError, ValueError) as error:  # a key missing, or a field of the wrong type (the error names it)
        raise ValueError(f"{noun} JSON does not describe a {noun}: {error}") from None


_PHASES = ("prefill", "decode")
_KV_CACHE_KEYS = {"format": str, "context": int, "bytes": int}


def _check_phase_peaks(peaks: Any) -> dict[str, int]:
    if not isinstance(peaks, dict):
        raise TypeError(f"FitPlan.phase_peaks must be a dict of phase -> bytes, got {type(peaks).__name__}: {peaks!r}")
    if peaks and sorted(peaks) != sorted(_PHASES):
        raise ValueError(f"FitPlan.phase_peaks must name the phases {', '.join(_PHASES)} or none, got {sorted(peaks)}")
    for phase, size in peaks.items():
        _check_bytes("FitPlan.phase_peaks", repr(phase), size)
    return dict(peaks)


def _check_kv_cache(kv_cache: Any) -> dict[str, Any]:
    if not isinstance(kv_cache, dict):
        raise TypeError(f"FitPlan.kv_cache must be a dict, got {type(kv_cache).__name__}: {kv_cache!r}")
    if kv_cache and set(kv_cache) != set(_KV_CACHE_KEYS):
        raise ValueError(
            f"FitPlan.kv_cache must have the keys {', '.join(_KV_CACHE_KEYS)} or none, got {sorted(kv_cache)}"
        )
    for key, kind in _KV_CACHE_KEYS.items():
        if key in kv_cache:
            value = kv_cache[key]
            if isinstance(value, bool) or not isinstance(value, kind) or (kind is int and value < 0):
                wanted = "an int >= 0" if kind is int else f"a {kind.__name__}"
                raise ValueError(f"FitPlan.kv_cache[{key!r}] must be {wanted}, got {value!r}")
    return dict(kv_cache)


def check_reserved(name: str, reserved: Any) -> dict[str, int]:
    """``reserved`` as a plan holds it (what for -> bytes), or a clear error naming ``name``."""
    if not isinstance(reserved, dict):
        raise TypeError(f"{name} must be a dict of str -> bytes, got {type(reserved).__name__}: {reserved!r}")
    for what, size in reserved.items():
        if not isinstance(what, str) or not what:
            raise TypeError(f"{name} keys must be non-empty str (what the bytes are for), got {what!r}")
        _check_bytes(name, repr(what), size)
    return dict(reserved)


__getattr__ = renamed(__name__, Plan=("FitPlan", lambda: FitPlan))
