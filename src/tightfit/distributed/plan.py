"""A :class:`StagePlan`: a model's layer stack cut into contiguous stages, one per rank (or
per device of one process), each stage's own fit within that rank's budget, made from the
config and the checkpoint's headers before any weight is read.

Each stage is planned by :func:`tightfit.fit` as a whole model is (the stage is the model
cut down, :mod:`tightfit.distributed.split`): its weights, its planned forward over the
inputs it receives, and for a generation its last decode step with its share of the KV
cache. Storages default to ``keep`` and placements to ``device``, so that a run across
ranks computes what one process computes; ``allow`` widens that.

How the layers are shared out: first in proportion to what each budget leaves after the
stage's own fixed parts (the embedding on the first, the head on the last), every stage at
least one layer; then each stage is fitted, and a stage over its budget gives its boundary
layer to the neighbour with the most room, until every stage fits. Where that goes round
in circles (an arrangement seen before, a one-layer stage over), each rank in turn takes as
many layers as fit, leaving one for each rank after it; where that fails too, no
arrangement fits, and a :class:`~tightfit.fitting.FitError` names the rank, its budget and
what dominates its peak.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit._files import parse_json
from tightfit._format import human_bytes
from tightfit._validate import check_count, check_type
from tightfit.distributed.link import HEADER_BYTES
from tightfit.distributed.pricing import Hop, device_hop, host_legs
from tightfit.distributed.split import check_kind, cut, layout_of
from tightfit.fitting import Allow, FitError, FitPlan, fit
from tightfit.fitting.plan import _check_seconds as check_plan_seconds
from tightfit.fitting.size import parse_size
from tightfit.fitting.traced import DECODE, DecodeTrace
from tightfit.kinds import CAUSAL_LM
from tightfit.loading.folder import folder_kind, model_folder, skeleton
from tightfit.loading.safetensors import Checkpoint
from tightfit.loading.stream import on_meta, stored_dtypes
from tightfit.memory.measure import tensor_bytes

__all__ = ["EXACT", "Stage", "StagePlan", "keeps_last_logits", "micro_batch_rows", "plan_stages", "stage_inputs"]

_FORMAT = "tightfit.stages/3"

#: What stages may use by default: weights as stored, on the stage's device, so that the
#: stages together compute what the whole model computes in one process.
EXACT = Allow(storage=frozenset({"keep"}), placement=frozenset({"device"}), hints=False)


@dataclass(frozen=True)
class Stage:
    """One stage: layers ``[start, end)`` of the stack on ``device`` (rank ``rank``), with
    the embedding where ``start == 0`` and the head where ``end`` is the stack's end;
    ``plan``: its fit of one micro-batch within ``budget_bytes`` less ``held_bytes`` (what
    it keeps across micro-batches: an encoder's last stage, the batch's embeddings), and
    ``compute_seconds`` its compute per run (every micro-batch); ``read_bytes``: the checkpoint bytes of its
    tensors, all that its rank reads; ``sent_bytes``: what it sends per run (its hidden
    states to the next stage; the last stage of a generation, each token back to the
    first) and ``send_seconds`` what that costs (None: not priced); ``why``: how it came
    to hold these layers."""

    rank: int
    device: str
    start: int
    end: int
    budget_bytes: int
    plan: FitPlan
    read_bytes: int
    sent_bytes: int
    send_seconds: float | None
    held_bytes: int
    compute_seconds: float
    why: str

    def __post_init__(self) -> None:
        for name in ("rank", "start", "read_bytes", "sent_bytes", "held_bytes"):
            check_count(f"Stage.{name}", getattr(self, name))
        check_plan_seconds("Stage", "compute_seconds", self.compute_seconds)
        if self.send_seconds is not None:  # None: not priced
            check_plan_seconds("Stage", "send_seconds", self.send_seconds)
        check_count("Stage.end", self.end, least=1)
        check_count("Stage.budget_bytes", self.budget_bytes, least=1)
        check_type("Stage.why", self.why, str)
        check_type("Stage.plan", self.plan, FitPlan)
        if device_name(self.device, "Stage.device") != self.device:
            raise ValueError(
                f"Stage.device={self.device!r} must be spelled {device_name(self.device, 'Stage.device')!r}"
            )

    @property
    def predicted_peak_bytes(self) -> int:
        return self.plan.predicted_peak_bytes + self.held_bytes

    def holds(self, layers: int, kind: str) -> str:
        """What the stage holds, in words: its layers and the ends of the model it has."""
        parts = [f"layers {self.start}-{self.end - 1}" if self.end - self.start > 1 else f"layer {self.start}"]
        if self.start == 0:
            parts.insert(0, "embedding")
        if self.end == layers:
            parts.append("norm, head" if kind == CAUSAL_LM else "pooler")
        return ", ".join(parts)


@dataclass(frozen=True)
class StagePlan:
    """Per rank, the :class:`Stage` it runs; ``kind``: ``"causal-lm"`` or ``"encoder"``;
    ``layers``: the stack's length; ``covers``: what each stage's prediction covers;
    ``checkpoint_bytes``: the whole checkpoint's tensor bytes (what one process reads);
    ``input_shape`` and ``max_new_tokens``: the run it was made for, which a run must be;
    ``micro_batches``: how many parts an encoder's batch goes through the stages in, one
    after another, so that the stages work on different parts at once; ``transfers``: how
    the sends between stages were priced, or why they were not."""

    model: str
    kind: str
    layers: int
    covers: str
    checkpoint_bytes: int
    input_shape: tuple[int, int]
    max_new_tokens: int
    micro_batches: int
    transfers: str
    stages: tuple[Stage, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("model", "covers", "transfers"):
            check_type(f"StagePlan.{name}", getattr(self, name), str)
        check_kind(self.kind)
        check_count("StagePlan.layers", self.layers, least=1)
        check_count("StagePlan.checkpoint_bytes", self.checkpoint_bytes)
        check_count("StagePlan.max_new_tokens", self.max_new_tokens)
        check_count("StagePlan.micro_batches", self.micro_batches, least=1)
        shape = self.input_shape
        if (
            not isinstance(shape, (list, tuple))
            or len(shape) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)
        ):
            raise ValueError(f"StagePlan.input_shape must be (batch, positions), two ints >= 1, got {shape!r}")
        object.__setattr__(self, "input_shape", tuple(shape))
        if self.micro_batches > shape[0] or (self.micro_batches > 1 and self.kind == CAUSAL_LM):
            raise ValueError(
                f"StagePlan.micro_batches={self.micro_batches}: an encoder's batch of {shape[0]} rows takes at most "
                f"{shape[0]}, a generation one"
            )
        if not isinstance(self.stages, (list, tuple)) or not all(isinstance(s, Stage) for s in self.stages):
            raise TypeError(f"StagePlan.stages must be a tuple of Stage, got {self.stages!r:.100}")
        object.__setattr__(self, "stages", tuple(self.stages))
        ranges = [(s.start, s.end) for s in self.stages]
        if (
            not self.stages
            or ranges[0][0] != 0
            or ranges[-1][1] != self.layers
            or any(a[1] != b[0] or a[0] >= a[1] for a, b in zip(ranges, ranges[1:] + [(self.layers, self.layers + 1)]))
        ):
            raise ValueError(f"StagePlan.stages must cover layers 0-{self.layers - 1} in order, got {ranges}")
        if [s.rank for s in self.stages] != list(range(len(self.stages))):
            raise ValueError(f"StagePlan.stages must be ranks 0..{len(self.stages) - 1} in order")

    def __str__(self) -> str:
        rows = [
            f"{self.model} ({self.kind}, {self.layers} layers) in {len(self.stages)} stages; each covers {self.covers}"
        ]
        if self.micro_batches > 1:
            rows[0] += f", in {self.micro_batches} micro-batches"
        rows.append(
            f"{'rank':>4}  {'device':<8} {'holds':<32} {'budget':>10} {'predicted':>10} {'reads':>10} {'sends':>10} "
            f"{'ms/run':>8} {'send ms':>8}  why"
        )
        for s in self.stages:
            rows.append(
                f"{s.rank:>4}  {s.device:<8} {s.holds(self.layers, self.kind):<32} {human_bytes(s.budget_bytes):>10} "
                f"{human_bytes(s.predicted_peak_bytes):>10} {human_bytes(s.read_bytes):>10} "
                f"{human_bytes(s.sent_bytes):>10} {s.compute_seconds * 1e3:>8.2f} {_milliseconds(s.send_seconds):>8}  "
                f"{s.why}"
            )
        compute = sum(s.compute_seconds for s in self.stages)
        sends = self.send_seconds
        how = (
            f"one micro-batch through every stage, then the busiest stage once for each micro-batch after "
            f"(compute {compute * 1e3:.2f} ms"
            + (f", sends {sends * 1e3:.2f} ms" if sends is not None else "")
            + " in all)"
            if self.micro_batches > 1
            else f"one stage after another: compute {compute * 1e3:.2f} ms"
            + (f" + sends {sends * 1e3:.2f} ms" if sends is not None else "")
        )
        rows.append(f"predicted: {self.predicted_seconds * 1e3:.2f} ms a run, {how}; sends {self.transfers}")
        return "\n".join(rows)

    def micro_batch_rows(self) -> list[slice]:
        """The batch's rows of each micro-batch, in order."""
        return micro_batch_rows(self.input_shape[0], self.micro_batches)

    def check_run(self, inputs: Any, max_new_tokens: int) -> None:
        """Nothing where ``inputs`` and ``max_new_tokens`` are the run this plan was made
        for; else a ValueError: a longer prompt or more tokens would outgrow its peaks."""
        check_type("inputs", inputs, Mapping)
        ids = inputs.get("input_ids")
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else None
        if shape != self.input_shape or max_new_tokens != self.max_new_tokens:
            raise ValueError(
                f"the plan was made for input_ids of shape {self.input_shape} and max_new_tokens="
                f"{self.max_new_tokens}; this run has {shape} and {max_new_tokens}: plan it again for this run"
            )

    @property
    def send_seconds(self) -> float | None:
        """The stages' sends per run, priced; None where they were not."""
        priced = [s.send_seconds for s in self.stages if s.send_seconds is not None]
        return sum(priced) if len(priced) == len(self.stages) else None

    @property
    def predicted_seconds(self) -> float:
        """A run's predicted seconds: each stage's compute and sends (where priced) for one
        micro-batch, one stage after another, then the busiest stage's part for each
        micro-batch after (while it works on one, the stages before it work on the next):
        its compute, its sends and its receives, which it waits through (a point-to-point
        send completes when its peer receives). With one micro-batch, the stages' sum."""
        parts = self.micro_batches
        sends = [(s.send_seconds or 0.0) / parts for s in self.stages]
        each = [s.compute_seconds / parts + send for s, send in zip(self.stages, sends)]
        busy = [part + (sends[index - 1] if index else 0.0) for index, part in enumerate(each)]
        return sum(each) + (parts - 1) * max(busy)

    def to_json(self) -> str:
        data = asdict(self) | {"format": _FORMAT}
        data["stages"] = [asdict(s) | {"plan": s.plan.to_dict()} for s in self.stages]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> StagePlan:
        """The plan :meth:`to_json` wrote; each stage's fit read back by ``FitPlan.from_json``."""
        check_type("text", text, str)
        data = parse_json(text, "text", what="is not JSON")
        if not isinstance(data, dict) or data.pop("format", None) != _FORMAT:
            raise ValueError(f"text is not a tightfit stage plan: expected a JSON object with format {_FORMAT!r}")
        if set(data) != {f.name for f in fields(cls)} or not isinstance(data["stages"], list):
            raise ValueError(f"text: a stage plan holds {sorted(f.name for f in fields(cls))}, got {sorted(data)}")
        stages = []
        try:
            for item in data.pop("stages"):
                if not isinstance(item, dict) or set(item) != {f.name for f in fields(Stage)}:
                    raise ValueError(f"each stage holds {sorted(f.name for f in fields(Stage))}, got {item!r:.200}")
                stages.append(Stage(**(item | {"plan": FitPlan.from_json(json.dumps(item["plan"]))})))
            return cls(**data, stages=tuple(stages))
        except (ValueError, TypeError) as error:
            raise ValueError(f"text: {error}") from None


def keeps_last_logits(stage: nn.Module) -> bool:
    """Whether ``stage`` is a causal LM's last stage whose forward can make the logits of
    the last position only (``logits_to_keep``): what a prefill needs of them."""
    return (
        isinstance(getattr(stage, "lm_head", None), nn.Linear)
        and "logits_to_keep" in inspect.signature(stage.forward).parameters
    )


def stage_inputs(stage: nn.Module, kind: str, inputs: Mapping[str, torch.Tensor], first: bool) -> dict:
    """What ``stage``'s forward takes for the first stage's ``inputs``: those on the first
    stage; after it, the hidden states received (``inputs_embeds``) and, for an encoder,
    the attention mask every stage applies. A causal LM's last stage keeps the logits of
    the last position only."""
    ids = inputs["input_ids"]
    if first:
        taken = dict(inputs)
    else:
        config = stage.config
        taken = {"inputs_embeds": torch.zeros(*ids.shape, config.hidden_size, dtype=stage.dtype, device=ids.device)}
        if kind != CAUSAL_LM and "attention_mask" in inputs:
            taken["attention_mask"] = inputs["attention_mask"]
    if kind == CAUSAL_LM and keeps_last_logits(stage):
        taken["logits_to_keep"] = torch.tensor([ids.shape[1] - 1], device=ids.device)
    return taken


def _decode_trace(stage: nn.Module, first: bool, context: int) -> DecodeTrace:
    """The stage's last decode step at ``context`` positions: a forward over ``context - 1``
    fills its cache, then the one-position forward, holding only the cache between them."""
    from tightfit.app import kv_cache

    def script(calls: Any) -> None:
        cache = kv_cache.cache_argument(stage)
        history = {"input_ids": torch.zeros(1, context - 1, dtype=torch.long, device=calls.device)}
        calls.call(**stage_inputs(stage, CAUSAL_LM, history, first), use_cache=True, **cache)
        calls.phase(DECODE)
        step = {"input_ids": torch.zeros(1, 1, dtype=torch.long, device=calls.device)}
        calls.call(**stage_inputs(stage, CAUSAL_LM, step, first), use_cache=True, **cache)

    per_token = kv_cache.bytes_per_token(stage.config, stage.dtype)
    return DecodeTrace(script, context, "model", context * per_token)


def device_name(device: Any, name: str) -> str:
    """``device`` as one spelling: ``cpu`` (any index), an accelerator with its index
    (``cuda`` is ``cuda:0``); a ValueError naming ``name`` where torch does not know it."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a device such as 'cpu' or 'cuda:0', got {type(device).__name__}: {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{name}={device!r} is not a device; accepted: 'cpu', 'cuda:0', 'xpu:1', ...") from None
    return "cpu" if parsed.type == "cpu" else f"{parsed.type}:{parsed.index or 0}"


def _budgets(budgets: Any) -> tuple[list[str], list[int]]:
    """(devices, bytes) from a list of sizes (ranks, on the CPU unless ``devices`` says) or
    a mapping device -> size (stages of one process, a device each)."""
    if isinstance(budgets, Mapping):
        if not budgets:
            raise ValueError("budgets is empty; give one size per rank, or a mapping device -> size")
        devices = [device_name(d, f"budgets key {d!r}") for d in budgets]
        if len(set(devices)) != len(devices):
            raise ValueError(f"budgets={dict(budgets)!r} names one device twice; give each device one size")
        return devices, [parse_size(v, f"budgets[{d!r}]") for d, v in budgets.items()]
    if isinstance(budgets, (str, int)) or not isinstance(budgets, Sequence) or not budgets:
        raise TypeError(
            f"budgets must be a non-empty list of sizes (one per rank, such as ['60MB', '60MB']) or a mapping "
            f"device -> size, got {type(budgets).__name__}: {budgets!r}"
        )
    return ["cpu"] * len(budgets), [parse_size(v, f"budgets[{i}]") for i, v in enumerate(budgets)]


def _check_inputs(inputs: Any, kind: str, max_new_tokens: int) -> torch.Tensor:
    """The first stage's ``input_ids``, once ``inputs`` holds what a stage run passes on:
    ``input_ids`` (2-D, int64, at least one position) and, for an encoder, an
    ``attention_mask`` of its shape; a generation's prompt is one sequence."""
    check_type("inputs", inputs, Mapping)
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or 0 in ids.shape:
        raise ValueError(f"inputs must hold 'input_ids', a 2-D int64 tensor of at least 1 x 1, got {ids!r:.100}")
    accepted = {"input_ids"} if kind == CAUSAL_LM else {"input_ids", "attention_mask"}
    unknown = sorted(set(inputs) - accepted)
    if unknown:
        raise ValueError(
            f"inputs holds {', '.join(map(repr, unknown))}, which stages do not pass on; accepted for a {kind}: "
            f"{', '.join(sorted(accepted))}"
        )
    mask = inputs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        raise ValueError(
            f"inputs' attention_mask must be a tensor of input_ids' shape {tuple(ids.shape)}, got {mask!r:.100}"
        )
    if kind == CAUSAL_LM and ids.shape[0] != 1:
        raise ValueError(
            f"a generation across stages takes one prompt (input_ids of shape 1 x N), got {tuple(ids.shape)}"
        )
    return ids


def _shares(fixed: list[int], budgets: list[int], layers: int) -> list[int]:
    """Layers per stage in proportion to what each budget leaves after its fixed parts,
    each at least one (largest remainders first)."""
    room = [max(b - f, 1) for b, f in zip(budgets, fixed)]
    total = sum(room)
    spare = layers - len(budgets)
    raw = [spare * r / total for r in room]
    counts = [1 + int(x) for x in raw]
    for index in sorted(range(len(raw)), key=lambda i: int(raw[i]) - raw[i])[: layers - sum(counts)]:
        counts[index] += 1
    return counts


def plan_stages(
    folder: str | Path,
    budgets: Sequence[int | str] | Mapping[str, int | str],
    inputs: Mapping[str, torch.Tensor],
    *,
    kind: str | None = None,
    max_new_tokens: int = 0,
    devices: Sequence[str] | None = None,
    allow: Allow | None = None,
    hops: Sequence[Hop] | None = None,
    micro_batches: int = 1,
) -> StagePlan:
    """The :class:`StagePlan` of a local Hugging Face folder over ``budgets``: a list, one
    size per rank (on ``devices``, default the CPU), or a mapping device -> size (stages
    of one process). ``inputs``: the first stage's (``input_ids``; an encoder's
    ``attention_mask``); ``max_new_tokens``: a causal LM's generation, whose last decode
    step (its KV cache at the prompt and the new tokens) every stage is planned for.
    ``allow``: what the stages' fits may use (default :data:`EXACT`). ``hops``: ranks'
    links, one per rank (:func:`~tightfit.distributed.pricing.measured_hops`), to price
    their sends with (None: not priced); the copies between the devices of one process are
    priced from their calibrations. ``micro_batches``: an encoder's batch split into this
    many parts, which go through the stages one after another, so that while a stage works
    on one part the stages before it work on the next (each stage is planned for the
    largest part). Nothing is read but
    the config and the checkpoint's headers; a :class:`~tightfit.fitting.FitError` where
    no arrangement fits, naming the rank."""
    path = model_folder(folder)
    stage_devices, budget_bytes = _budgets(budgets)
    if devices is not None:
        if isinstance(budgets, Mapping) or isinstance(devices, str) or not isinstance(devices, Sequence):
            raise TypeError(
                f"devices={devices!r} must be a list of devices, one per budget (only with a list of budgets)"
            )
        if len(devices) != len(budget_bytes):
            raise ValueError(f"devices={devices!r} must name one device per budget ({len(budget_bytes)})")
        stage_devices = [device_name(d, f"devices[{i}]") for i, d in enumerate(devices)]
    check_count("max_new_tokens", max_new_tokens)
    check_type("allow", allow, (Allow, type(None)))
    _check_hops(hops, budgets, len(budget_bytes))
    kind = check_kind(kind or folder_kind(path))
    ids = _check_inputs(inputs, kind, max_new_tokens)
    _check_micro_batches(micro_batches, kind, ids.shape[0])
    rows = micro_batch_rows(ids.shape[0], micro_batches)
    model, config = skeleton(path, kind)
    layout = layout_of(model, kind)
    layers = layout.layers(model)
    ranks = len(budget_bytes)
    if layers < ranks:
        raise ValueError(
            f"{ranks} ranks for {layers} layers: every stage needs at least one layer; use at most {layers} ranks"
        )
    if kind == CAUSAL_LM and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: a causal LM's stages generate; give at least 1 token")
    if max_new_tokens and kind != CAUSAL_LM:
        raise ValueError(f"max_new_tokens={max_new_tokens} is for a causal LM's generation; {path} is run as {kind}")
    checkpoint = Checkpoint(path)
    context = ids.shape[1] + max_new_tokens - 1
    part = (rows[0].stop - rows[0].start, ids.shape[1])
    covers = (
        f"the prefill over {ids.shape[1]} positions and the last of {max_new_tokens - 1} decode steps, its KV cache "
        f"at {context} positions"
        if max_new_tokens > 1
        else f"one forward over inputs of shape {part}"
    )
    hidden = int(config.hidden_size)

    def held(end: int) -> int:  # an encoder's last stage keeps the batch's float32 embeddings across micro-batches
        return ids.shape[0] * hidden * torch.float32.itemsize if micro_batches > 1 and end == layers else 0

    first_part = on_meta({name: tensor[rows[0]] for name, tensor in inputs.items()})  # what each stage is fitted on
    cuts: dict[tuple[int, int], nn.Module] = {}  # each range cut from its own skeleton once
    fitted: dict[tuple[int, int, int], FitPlan | FitError] = {}

    def stage_of(start: int, end: int) -> nn.Module:
        if (start, end) not in cuts:
            cuts[start, end] = cut(skeleton(path, kind)[0], kind, start, end)
        return cuts[start, end]

    def stage_fit(rank: int, start: int, end: int) -> FitPlan | FitError:
        key = (rank, start, end)
        if key not in fitted:
            stage = stage_of(start, end)
            example = stage_inputs(stage, kind, first_part, start == 0)
            trace = _decode_trace(stage, start == 0, context) if max_new_tokens > 1 else None
            try:
                fitted[key] = fit(
                    stage,
                    example,
                    max(budget_bytes[rank] - held(end), 1),
                    backend=stage_devices[rank],
                    allow=allow or EXACT,
                    loading=True,
                    stored_dtypes=stored_dtypes(stage, path),
                    decode=trace,
                    decode_steps=max(max_new_tokens - 1, 0),
                )
            except FitError as error:
                fitted[key] = error
        return fitted[key]

    fixed = [
        _modules_bytes(model, (layout.first if r == 0 else ()) + (layout.last if r == ranks - 1 else ()))
        for r in range(ranks)
    ]
    bounds, results, moved = _balanced(stage_fit, held, fixed, budget_bytes, layers)
    if bounds is None:
        bounds, results = _filled(stage_fit, ranks, layers)
        moved = {
            r: "as many layers as fit, front to back: no share in proportion to the budgets fits" for r in range(ranks)
        }
    if bounds is None:
        rank, start, end = results
        reason = "it is the only rank" if ranks == 1 else "no arrangement of the layers over the ranks fits"
        raise _refusal(rank, start, end, stage_fit(rank, start, end), held(end), stage_devices, layers, reason)
    in_process = isinstance(budgets, Mapping)
    calibrations = {stage_devices[r]: results[r].calibration for r in range(ranks)}
    ends = [(stage_devices[r], stage_devices[(r + 1) % ranks]) for r in range(ranks)]
    if in_process and ranks > 1:
        hops = [device_hop(source, target, calibrations) for source, target in ends]
    elif hops:  # ranks on accelerators send through host memory
        hops = [
            hop.through_host(host_legs(source, target, calibrations), f"{source} and {target}")
            for hop, (source, target) in zip(hops, ends)
        ]
    stages = []
    for r in range(ranks):
        start, end = bounds[r], bounds[r + 1]
        stage = stage_of(start, end)
        why = moved.get(r) or f"{end - start} of {layers} layers, in proportion to its budget after its fixed parts"
        messages = _messages(kind, r, ranks, tuple(ids.shape), max_new_tokens, hidden, stage.dtype, rows)
        header = 0 if in_process else HEADER_BYTES  # a copy between devices has no header
        sent = sum(count * (nbytes + header) for count, nbytes in messages)
        seconds = hops[r].seconds(messages) if hops else 0.0 if ranks == 1 else None
        read = _read_bytes(stage, checkpoint)
        compute = results[r].predicted_seconds * micro_batches
        stages.append(
            Stage(
                r,
                stage_devices[r],
                start,
                end,
                budget_bytes[r],
                results[r],
                read,
                sent,
                seconds,
                held(end),
                compute,
                why,
            )
        )
    total = sum(e.nbytes for e in checkpoint.entries.values())
    return StagePlan(
        type(model).__name__,
        kind,
        layers,
        covers,
        total,
        tuple(ids.shape),
        max_new_tokens,
        micro_batches,
        _transfers(hops, ranks),
        tuple(stages),
    )


def micro_batch_rows(batch: int, parts: int) -> list[slice]:
    """``batch`` rows in ``parts`` micro-batches, the first ``batch % parts`` a row larger."""
    check_count("batch", batch, least=1)
    check_count("parts", parts, least=1)
    if parts > batch:
        raise ValueError(f"parts={parts} micro-batches of a batch of {batch} rows: give at most {batch}")
    size, larger = divmod(batch, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + size + (index < larger))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _check_micro_batches(micro_batches: Any, kind: str, batch: int) -> None:
    check_count("micro_batches", micro_batches, least=1)
    if micro_batches > 1 and kind == CAUSAL_LM:
        raise ValueError(
            f"micro_batches={micro_batches}: a generation across stages is one prompt, one micro-batch; "
            f"micro-batches split an encoder's batch"
        )
    if micro_batches > batch:
        raise ValueError(f"micro_batches={micro_batches} is more than the batch's {batch} rows; give at most {batch}")


def _check_hops(hops: Any, budgets: Any, ranks: int) -> None:
    """``hops`` is None or one :class:`Hop` per rank, and only for ranks (a list of budgets)."""
    if hops is None:
        return
    if isinstance(budgets, Mapping):
        raise ValueError(
            "hops are the links between ranks; the copies between the devices of one process (a mapping of "
            "budgets) are priced from their calibrations: leave hops out"
        )
    if not isinstance(hops, Sequence) or len(hops) != ranks or not all(isinstance(h, Hop) for h in hops):
        raise ValueError(f"hops must be one Hop per rank ({ranks}), such as measured_hops gives, got {hops!r:.200}")


def _transfers(hops: Sequence[Hop] | None, ranks: int) -> str:
    """How the plan's sends were priced, in words, or why they were not."""
    if ranks == 1:
        return "none: one stage"
    if not hops:
        return "not priced: the ranks measure their links when they meet (plan_stages' hops)"
    return "priced per hop: " + "; ".join(f"rank {r} {hop.how}" for r, hop in enumerate(hops))


def _milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def _balanced(
    stage_fit: Any, held: Any, fixed: list[int], budgets: list[int], layers: int
) -> tuple[list[int] | None, list[Any], dict[int, str]]:
    """(bounds, each stage's fit, why) of the layers shared in proportion to the budgets,
    a stage over its budget giving its boundary layer to the neighbour with the most room
    (its budget less its fit's peak and what it holds, ``held(end)``); bounds None where
    that reaches an arrangement seen before or a one-layer stage over."""
    ranks = len(budgets)
    counts = _shares(fixed, budgets, layers)
    seen: set[tuple[int, ...]] = set()
    moved: dict[int, str] = {}
    while True:
        seen.add(tuple(counts))
        bounds = [sum(counts[:r]) for r in range(ranks + 1)]
        results = [stage_fit(r, bounds[r], bounds[r + 1]) for r in range(ranks)]
        over = [r for r, result in enumerate(results) if isinstance(result, FitError)]
        if not over:
            return bounds, results, moved
        rank = over[0]
        room = {
            n: budgets[n]
            - (results[n].predicted_peak_bytes + held(bounds[n + 1]) if isinstance(results[n], FitPlan) else budgets[n])
            for n in (rank - 1, rank + 1)
            if 0 <= n < ranks
        }
        if not room or counts[rank] == 1:
            return None, results, moved
        to = max(room, key=room.get)
        counts[rank] -= 1
        counts[to] += 1
        moved[rank] = f"gave layers to rank {to}: its budget could not hold its share"
        moved[to] = f"took layers from rank {rank}, whose budget could not hold its share"
        if tuple(counts) in seen:
            return None, results, moved


def _filled(stage_fit: Any, ranks: int, layers: int) -> tuple[list[int] | None, Any]:
    """(bounds, each stage's fit) with each rank, front to back, taking as many layers as
    fit (found by bisection, a stage's peak growing with its layers) and leaving one for
    each rank after it: where any arrangement fits, this one does. Where none does:
    (None, (rank, start, end)) of the first stage that cannot fit even its least."""
    bounds = [0]
    for rank in range(ranks):
        start = bounds[-1]
        most = layers - (ranks - 1 - rank)
        if rank == ranks - 1:
            if isinstance(stage_fit(rank, start, layers), FitError):
                return None, (rank, start, layers)
            bounds.append(layers)
            break
        if isinstance(stage_fit(rank, start, start + 1), FitError):
            return None, (rank, start, start + 1)
        low, high = start + 1, most  # low fits; find the largest end that fits
        while low < high:
            middle = (low + high + 1) // 2
            if isinstance(stage_fit(rank, start, middle), FitError):
                high = middle - 1
            else:
                low = middle
        bounds.append(low)
    return bounds, [stage_fit(r, bounds[r], bounds[r + 1]) for r in range(ranks)]


def _modules_bytes(model: nn.Module, names: tuple[str, ...]) -> int:
    """Bytes of the named modules' tensors (on meta: what they will hold)."""
    modules = [model.get_submodule(name) for name in names]
    return tensor_bytes(t for module in modules for t in [*module.parameters(), *module.buffers()])


def _messages(
    kind: str,
    rank: int,
    ranks: int,
    ids: tuple[int, int],
    new_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    rows: list[slice],
) -> list[tuple[int, int]]:
    """What stage ``rank`` sends per run, as (how many, data bytes each): its hidden states
    (an encoder's once per micro-batch of ``rows``; a generation's prefill, then one
    position per step), or a generation's tokens back to the first."""
    if ranks == 1:
        return []
    if rank < ranks - 1:
        if kind != CAUSAL_LM:
            return [(1, (part.stop - part.start) * ids[1] * hidden * dtype.itemsize) for part in rows]
        return [(1, ids[1] * hidden * dtype.itemsize), (new_tokens - 1, hidden * dtype.itemsize)]
    return [(new_tokens - 1, torch.int64.itemsize)] if kind == CAUSAL_LM else []


def _read_bytes(stage: nn.Module, checkpoint: Checkpoint) -> int:
    """The checkpoint bytes of the stage's tensors: what its rank reads."""
    prefix = getattr(stage, "base_model_prefix", "") or ""
    names = {n for n, _ in stage.named_parameters()} | {n for n, _ in stage.named_buffers()}
    found = {checkpoint.find([name], prefix) for name in names} - {None}
    return sum(checkpoint.entries[name].nbytes for name in found)


def _refusal(
    rank: int, start: int, end: int, error: FitError, held: int, devices: list[str], layers: int, reason: str
) -> FitError:
    """The stage's fit refusal for the rank: its budget and smallest peak with what it
    holds across micro-batches (``held``, which its fit's budget left out) added back."""
    span = f"layers {start}-{end - 1}" if end - start > 1 else f"layer {start}"
    parts = "; ".join(f"{part}: {human_bytes(size)}" for part, size in error.parts[:3])
    budget, smallest = error.budget_bytes + held, error.smallest_peak_bytes + held
    holding = f", holding the batch's embeddings ({human_bytes(held)})" if held else ""
    return FitError(
        f"rank {rank} ({devices[rank]}, budget {human_bytes(budget)}) cannot hold its stage ({span} of "
        f"{layers}{holding}), and {reason}: its smallest peak is {human_bytes(smallest)} ({smallest:,} B); largest "
        f"parts: {parts}. Give rank {rank} at least {human_bytes(smallest)}, or more ranks",
        budget_bytes=budget,
        smallest_peak_bytes=smallest,
        parts=error.parts,
    )
