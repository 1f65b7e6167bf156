"""The main job behind ``tightfit run``: load a model, pick a backend, optionally make its
weights compact (quantization, float8 storage) or move them off the device (offloading),
run it, and report latency, memory measured on the device and, where weights changed,
quality against full precision. Encoders embed sentences (quality: cosine); causal LMs
generate text greedily (quality: token agreement). With a memory budget the fit planner
chooses those changes (``tightfit.fit``) and the report sets its prediction against the
measurement."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from tightfit import backends
from tightfit._deprecation import renamed
from tightfit._format import human_bytes
from tightfit._validate import check_choice, check_type
from tightfit.app import kv_cache
from tightfit.app.budget import Budgeted, measure_load, plan_run, read_plan
from tightfit.app.generation_job import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROMPT
from tightfit.app.jobs import Job
from tightfit.app.models import ENCODER, default_model_dir, folder_kind
from tightfit.app.spelling import assigned, option
from tightfit.backends.resolve import ResolvedBackend
from tightfit.fitting import Allow, FitPlan, held_bytes, parse_size
from tightfit.fitting.options import UNIT_SIZES
from tightfit.fitting.quality import parse_error
from tightfit.hooks import OFFLOAD_TARGETS, apply_layerwise_casting, apply_offloading, resident_bytes
from tightfit.kinds import get_kind, kind_names
from tightfit.loading import load, skeleton, stored_dtypes
from tightfit.loading.stored import holds_quantized
from tightfit.memory import Measurement, measure, tensor_bytes
from tightfit.memory.plot import check_png_path
from tightfit.quant import (
    COMPUTE_CHOICES,
    Blockwise8Config,
    Linear8bit,
    NF4Config,
    QuantConfig,
    layer_stack,
    quantize_,
    storage_formats,
    unregistered_tensors,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_PROMPT",
    "DEFAULT_SENTENCES",
    "STORAGE_DTYPE_CHOICES",
    "RunOptions",
    "RunReport",
    "RunStart",
    "plan_only",
    "quant_configs",
    "run",
    "weights_bytes",
]


def quant_configs() -> dict[str, QuantConfig]:
    """``--quant`` choices: the storage catalogue's quantized formats, each with the config
    it applies to every ``nn.Linear``; with ``keep_8bit`` the 4-bit ones (nf4, fp4) store
    the later half of the model's layer stack in 8 bits. Read from the catalogue each
    time, so a format registered later is a choice."""
    return {storage.name: storage.config for storage in storage_formats() if storage.config is not None}


#: The quant configs ``--compute`` applies to (their ``compute`` field).
COMPUTE_CONFIGS = (NF4Config, Blockwise8Config)

#: ``--storage-dtype`` choices: layerwise casting stores weights so and computes in the model's dtype.
STORAGE_DTYPE_CHOICES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

DEFAULT_SENTENCES: tuple[str, ...] = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A woman is holding an infant in her arms.",
    "A man is riding a horse.",
    "Someone on horseback rides across a field.",
    "The new movie is awesome.",
    "The film was a great success with critics.",
)

#: ``--graph``: decode from a captured CUDA graph where the run allows it, always (or refuse), never.
GRAPH_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class RunOptions:
    """What to run. ``model`` None means the built-in default; ``backend`` None the default backend.

    ``keep_8bit`` (with a 4-bit ``quant``): the Linear layers of the later half of the
    model's layer stack (:func:`tightfit.quant.layer_stack`) are stored in blockwise 8-bit,
    the rest in 4 bits; False stores every Linear layer in 4 bits. ``compute`` (with a
    4-bit ``quant``): how the 4-bit layers multiply, ``"float"`` or ``"int8"`` (activations
    quantized to int8, integer dot products: faster on CPUs, less exact).

    ``sentences`` are what an encoder embeds; ``prompt`` and ``max_new_tokens`` (None:
    :data:`DEFAULT_PROMPT`, :data:`DEFAULT_MAX_NEW_TOKENS`) what a causal LM continues, and
    are refused for an encoder. ``timeline``: write a PNG of the memory over one run there.

    ``budget``: the device memory the run may use, bytes or a size (``"40MB"``, stored as
    bytes); the fit planner then chooses storage and placement per unit, so ``quant``,
    ``storage_dtype`` and ``offload`` are refused with it. ``allow``: what the planner may
    use, a ``--allow`` string (``"keep,float8,disk"``: only the kinds named are restricted),
    an :class:`~tightfit.fitting.Allow` or a dict; stored as an Allow; needs ``budget``.

    ``reference``: where weights change, also run the full-precision model for the quality
    figures (False: no quality figures; a model the machine cannot hold twice).

    ``plan``: a plan made before (``tightfit fit --json``'s output, or ``FitPlan.to_json()``,
    as a file path, or a :class:`~tightfit.fitting.FitPlan`) carried out as it is, its budget
    the run's; it replaces ``budget``, ``allow`` and ``context``, and a run whose KV cache
    needs more than the plan reserved is refused before any weight is read.

    ``context`` (a causal LM with a budget): the positions its KV cache is planned for,
    prompt and generated tokens (None: what the run reaches, the prompt and
    ``max_new_tokens`` - 1 fed back); ``"auto"``: the longest context the budget allows, at
    least the run's own, at most the model's ``max_position_embeddings``.

    ``max_error`` (with a budget): the most expected error the plan may take to meet it, a
    fraction or a percentage (``"5%"``; :func:`tightfit.fit`'s; stored as a fraction).

    ``kv_cache`` (a causal LM): the KV cache's format, ``"model"`` (the model's dtype),
    ``"float8"`` (:mod:`tightfit.app.kv_cache`) or ``"auto"``: the model's, unless the
    budget holds the run (or, with ``context="auto"``, a longer context) only with float8.

    ``graph`` (a causal LM): decode by replaying one captured CUDA graph of the step
    (:mod:`tightfit.app.captured`), which removes the host's work per token, the bound on a
    small model's decoding speed on a GPU. ``"auto"``: where the run allows it (a CUDA
    device, every weight on it, the KV cache in the model's dtype); ``"on"``: refused with
    the reason where it does not; ``"off"``: never.

    ``units`` (with a budget): what the planner decides for per layer, ``"layers"`` (a
    whole layer) or ``"blocks"`` (its attention, its feed-forward network, each expert of
    a mixture of experts; :func:`tightfit.fit`'s ``units``).
    """

    model: str | None = None
    backend: str | None = None
    quant: str | None = None
    storage_dtype: str | None = None
    offload: str | None = None
    repeat: int = 5
    sentences: tuple[str, ...] = DEFAULT_SENTENCES
    top_pairs: int = 3
    keep_8bit: bool = True
    compute: str = "float"
    prompt: str | None = None
    max_new_tokens: int | None = None
    timeline: str | Path | None = None
    budget: int | str | None = None
    allow: Allow | Mapping[str, Any] | str | None = None
    reference: bool = True
    context: int | str | None = None
    plan: FitPlan | str | Path | None = None
    max_error: float | str | None = None
    kv_cache: str = "auto"
    graph: str = "auto"
    units: str = "layers"

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise TypeError(f"model must be a folder path or None, got {type(self.model).__name__}: {self.model!r}")
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str or None, got {type(self.backend).__name__}: {self.backend!r}")
        if self.quant is not None and self.quant not in quant_configs():
            raise ValueError(f"quant={self.quant!r} is not accepted; accepted: {', '.join(quant_configs())} or None")
        if self.storage_dtype is not None and self.storage_dtype not in STORAGE_DTYPE_CHOICES:
            raise ValueError(
                f"storage_dtype={self.storage_dtype!r} is not accepted; accepted: {', '.join(STORAGE_DTYPE_CHOICES)} or None"
            )
        if self.quant is not None and self.storage_dtype is not None:
            raise ValueError("quant and storage_dtype both change how weights are stored; choose one")
        if self.offload is not None and self.offload not in OFFLOAD_TARGETS:
            raise ValueError(
                f"offload={self.offload!r} is not accepted; accepted: {', '.join(OFFLOAD_TARGETS)} or None"
            )
        for name in ("repeat", "top_pairs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option(name)} must be an int >= 1, got {value!r}")
        if not isinstance(self.keep_8bit, bool):
            raise TypeError(f"keep_8bit must be a bool, got {type(self.keep_8bit).__name__}: {self.keep_8bit!r}")
        check_choice(option("compute"), self.compute, COMPUTE_CHOICES)
        if self.compute != "float" and not isinstance(quant_configs().get(self.quant), COMPUTE_CONFIGS):
            raise ValueError(
                f"{assigned('compute', self.compute)} needs a blockwise quant (nf4, fp4 or 8bit), got quant={self.quant!r}"
            )
        if (
            not isinstance(self.sentences, tuple)
            or len(self.sentences) < 2
            or not all(isinstance(s, str) and s.strip() for s in self.sentences)
        ):
            raise ValueError("sentences must be a tuple of at least two non-empty strings")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt.strip()):
            raise ValueError(f"{option('prompt')} must be a non-empty string or None, got {self.prompt!r}")
        if self.max_new_tokens is not None and (
            isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1
        ):
            raise ValueError(f"{option('max_new_tokens')} must be an int >= 1 or None, got {self.max_new_tokens!r}")
        if self.timeline is not None:
            check_png_path("timeline", self.timeline, "tightfit run --timeline")
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_size(self.budget, "budget"))
            chosen = [name for name in ("quant", "storage_dtype", "offload") if getattr(self, name) is not None]
            if chosen:
                raise ValueError(
                    f"{option('budget')} lets the fit planner choose how weights are stored and where; it cannot be "
                    f"combined with {', '.join(map(option, chosen))}; drop {'them' if len(chosen) > 1 else 'it'}, "
                    f"or restrict the planner with {option('allow')}"
                )
        if self.plan is not None:
            given = [
                name
                for name in ("budget", "allow", "context", "max_error", "quant", "storage_dtype", "offload")
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(
                    f"{option('plan')} carries out a plan made before, with its own budget, placements and "
                    f"context; drop {', '.join(map(option, given))}"
                )
            plan = self.plan if isinstance(self.plan, FitPlan) else read_plan(self.plan)
            object.__setattr__(self, "plan", plan)
            object.__setattr__(self, "budget", plan.budget_bytes)
        if self.context is not None:
            if self.context != "auto" and (
                isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1
            ):
                raise ValueError(f"{option('context')} must be an int >= 1 (positions) or 'auto', got {self.context!r}")
            if self.budget is None:
                raise ValueError(
                    f"{assigned('context', self.context)} plans the KV cache within a budget; give {option('budget')} too"
                )
        check_choice(option("kv_cache"), self.kv_cache, ("auto", *kv_cache.KV_FORMATS))
        check_choice(option("graph"), self.graph, GRAPH_CHOICES)
        check_choice(option("units"), self.units, UNIT_SIZES)
        if self.units != "layers" and (self.budget is None or self.plan is not None):
            raise ValueError(
                f"{assigned('units', self.units)} is how the fit planner cuts layers into units; it plans only with "
                f"{option('budget')}, not with {option('plan')} (made with its own units)"
            )
        if self.max_error is not None:
            object.__setattr__(self, "max_error", parse_error(self.max_error, option("max_error")))
            if self.budget is None:
                raise ValueError(
                    f"{assigned('max_error', self.max_error)} bounds the fit planner, which runs only with a budget; "
                    f"give {option('budget')} too"
                )
        if self.allow is not None and self.budget is None:
            raise ValueError(
                f"{assigned('allow', self.allow)} restricts the fit planner, which runs only with a budget; "
                f"give {option('budget')} too"
            )
        if self.allow is not None:
            object.__setattr__(self, "allow", Allow.coerce(self.allow))
        if not isinstance(self.reference, bool):
            raise TypeError(f"reference must be a bool, got {type(self.reference).__name__}: {self.reference!r}")


#: Each option's default: an option of another kind is refused unless it is left so.
_DEFAULTS = {option_field.name: option_field.default for option_field in fields(RunOptions)}


@dataclass(frozen=True)
class RunStart:
    """What a run knows before it measures, given to ``run``'s ``on_start``: the
    model (as the report names it) and its kind, the backend and device, and with a
    budget the plan (``budgeted``) that loading is about to carry out."""

    model: str
    kind: str
    backend: str
    device: str
    budget_bytes: int | None = None
    budgeted: Budgeted | None = None


@dataclass
class RunReport:
    """What a run measured. ``kind`` says which fields apply: an encoder's embeddings and
    cosine, a causal LM's generated text, speeds and token agreement, or those a
    registered kind's job fills. ``quality`` is the kind's figure against full precision
    (``quality_metric`` names it)."""

    model: str
    backend: str
    device: str
    weights_bytes: int
    embedding_dim: int | None  # encoders
    measurement: Measurement  # seconds: whole calls (an embedding batch, a generation)
    pairs: list[tuple[str, str, float]] = field(default_factory=list)
    quant: str | None = None
    full_weights_bytes: int | None = None  # before quantization, casting or offloading
    min_cosine_to_full: float | None = None  # embeddings after those against before
    kept_8bit: tuple[str, ...] = ()  # layers a 4-bit quant stored in 8 bits instead
    kept_8bit_linears: int = 0  # how many Linear layers those hold
    kept_8bit_bytes: int = 0  # what they take, stored in 8 bits
    storage_dtype: str | None = None
    offload: str | None = None
    device_weights_bytes: int | None = None  # held in the device's memory between forwards
    kind: str = ENCODER
    quality: float | None = None  # the kind's figure against full precision, where weights changed
    quality_metric: str = ""
    prompt: str | None = None  # causal LMs, from here on
    prompt_tokens: int = 0
    generated_text: str | None = None
    new_tokens: int = 0
    time_to_first_token_seconds: float | None = None  # median over the timed runs
    decode_tokens_per_second: float | None = None  # median; None for a single new token
    decode_graph: bool | None = None  # decoding replayed a captured CUDA graph (--graph)
    full_text: str | None = None  # what full precision generated, when weights changed
    token_agreement: float | None = None  # greedy next tokens kept, teacher-forced on full_text's tokens
    timeline_path: str | None = None
    budget_bytes: int | None = None  # with a budget, from here on
    budgeted: Budgeted | None = None  # the plan and what its prediction covers
    load_seconds: float | None = None  # with a budget: streaming the checkpoint into the plan
    load_peak_bytes: int | None = None  # on the device while loading
    load_peak_rss_bytes: int | None = None  # the process's, while loading

    @property
    def measured_peak_bytes(self) -> int:
        """The most on the device over the whole run: loading (with a budget) and the measured calls."""
        return max(self.measurement.allocated_peak_bytes, self.load_peak_bytes or 0)

    @property
    def predicted_peak_bytes(self) -> int | None:
        return None if self.budgeted is None else self.budgeted.predicted_peak_bytes

    @property
    def changes(self) -> str | None:
        """What was done to the weights, for labels: ``nf4``, ``float8_e4m3fn + offload disk``, ``plan for 38.1 MiB``."""
        if self.budgeted is not None:
            return None if self.budgeted.plan.applies_nothing else f"plan for {human_bytes(self.budget_bytes)}"
        parts = [self.quant or self.storage_dtype, f"offload {self.offload}" if self.offload else None]
        return " + ".join(p for p in parts if p) or None


def _setup(options: RunOptions | None) -> tuple[RunOptions, ResolvedBackend, Path, str]:
    """The options checked, the backend and device (resolved here, once for the run, and
    passed down), the model folder and its kind."""
    options = options or RunOptions()
    if not isinstance(options, RunOptions):
        raise TypeError(f"options must be RunOptions, got {type(options).__name__}")
    backend = backends.get(options.backend) if options.backend else backends.default()
    device = backend.resolve_device(options.backend if options.backend and ":" in options.backend else None)
    if options.plan is not None and str(device) != options.plan.device:
        if options.backend is not None:
            raise ValueError(
                f"{assigned('backend', options.backend)} is {device}, but the plan is for {options.plan.device}; "
                f"leave {option('backend')} out, or plan again for {device}"
            )
        backend = backends.get(options.plan.backend)  # a plan runs where it was made for
        device = backend.resolve_device(options.plan.device if ":" in options.plan.device else None)
    device = torch.device("cpu") if device.type == "cpu" else device  # tensors say "cpu", never "cpu:0"
    folder = Path(options.model) if options.model is not None else default_model_dir()
    kind = get_kind(folder_kind(folder))
    given = list(
        dict.fromkeys(  # in order, once each: an option may be several kinds'
            name
            for other in map(get_kind, kind_names())
            for name in other.run_options
            if name not in kind.run_options and getattr(options, name) != _DEFAULTS[name]
        )
    )
    if given:
        named = "the built-in model" if options.model is None else assigned("model", str(folder))
        owners = sorted({other.noun for other in map(get_kind, kind_names()) if set(given) & set(other.run_options)})
        verb = "apply" if len(given) > 1 else "applies"
        raise ValueError(
            f"{' and '.join(map(option, given))} {verb} to {' and '.join(f'{noun}s' for noun in owners)}; "
            f"{named} is {kind.described}"
        )
    return options, ResolvedBackend([backend], device), folder, kind.name


def _planned(options: RunOptions, resolved: ResolvedBackend, folder: Path, kind: str) -> tuple[Job, Budgeted]:
    """The run's job on the skeleton (no weight read: the checkpoint's headers give the
    dtype each tensor is stored in) and its plan for the budget, loading covered."""
    if holds_quantized(folder):
        raise ValueError(
            f"{assigned('model', str(folder))} holds quantized weights (a bitsandbytes quantization_config, or a folder "
            f"tightfit.save wrote): tightfit run and fit plan full-precision checkpoints for now; load it with "
            f"tightfit.load(folder, budget) from Python"
        )
    job = _job(kind, folder, resolved.device, options, resolved.backends[0], skeleton(folder, kind)[0])
    if options.plan is not None:
        return job, job.carried_out(options.plan)
    dtypes = stored_dtypes(job.model, folder)

    def plan() -> Budgeted:
        return plan_run(
            job.model,
            job.example_inputs(),
            options.budget,
            backend=resolved,
            allow=options.allow,
            covers=job.covers(),
            decode=job.decode_trace(),
            loading=True,
            stored_dtypes=dtypes,
            max_error=options.max_error,
            decode_steps=job.decode_steps(),
            units=options.units,
        )

    def planned() -> Budgeted:
        budgeted = job.longest_context(plan, options.budget) if options.context == "auto" else plan()
        return replace(budgeted, context=job.planned_context(), kv_format=job.kv_format)

    return job, job.choose_kv_format(planned, options.kv_cache, options.budget)


def plan_only(options: RunOptions) -> Budgeted:
    """The plan ``run(options)`` would carry out, made from the folder's config and its
    checkpoint's headers (the dtypes its tensors are stored in): no weight byte is read
    (``tightfit fit``, the dry run). ``options.budget`` is needed;
    raises :class:`tightfit.FitError` when nothing fits."""
    options, resolved, folder, kind = _setup(options)
    if options.budget is None:
        raise ValueError(f"{option('budget')} is needed to plan (bytes or a size such as '6GB')")
    return _planned(options, resolved, folder, kind)[1]


def run(options: RunOptions | None = None, *, on_start: Callable[[RunStart], Any] | None = None) -> RunReport:
    """Run the main job and return its report.

    ``on_start`` is called once with what the run knows before it measures
    (:class:`RunStart`), so that a caller can show it at once rather than after the run
    (``tightfit run`` does): with a budget, the plan, before any weight is read; without
    one, once the model has loaded (a folder that does not load is an error before it).
    """
    if on_start is not None and not callable(on_start):
        raise TypeError(f"on_start must be None or a callable, got {type(on_start).__name__}: {on_start!r}")
    options, resolved, folder, kind = _setup(options)
    backend, device = resolved.backends[0], resolved.device
    budgeted, loaded = None, None
    start = RunStart(_described(options, folder), kind, backend.name, str(device), options.budget)
    if options.budget is not None:  # plan from the config, then stream the checkpoint into the plan
        job, budgeted = _planned(options, resolved, folder, kind)
        if on_start is not None:
            on_start(replace(start, budgeted=budgeted))
        loaded = measure_load(
            lambda: load(folder, plan=budgeted.plan, kind=kind, model=job.model, backend=resolved)[0], device
        )
        job.model = loaded.model
        job.headroom = options.budget - budgeted.plan.predicted_peak_bytes
        kept: tuple[str, ...] = ()
        changes = not budgeted.plan.applies_nothing
        full_weights = _full_weights_bytes(budgeted.plan) if changes else None
        reference = None  # computed after the measured run, from the full-precision model, where it fits
    else:
        job = _job(kind, folder, device, options, backend)
        if on_start is not None:
            on_start(start)
        changes = bool(options.quant or options.storage_dtype or options.offload)
        full_weights = weights_bytes([job.model]) if changes else None
        reference = (
            job.result() if changes and options.reference else None
        )  # before any change, outside the measured run
        kept = _convert(job.model, options, device)
    kept_linears = [
        module for name in kept for module in job.model.get_submodule(name).modules() if isinstance(module, Linear8bit)
    ]
    weights = weights_bytes([job.model])
    if budgeted is not None:
        on_device = held_bytes(job.model, device)  # counts the scales of offloaded quantized units too
    else:
        on_device = resident_bytes(job.model, device) if options.offload else weights
    measurement = measure(
        job.call,
        device,
        repeat=options.repeat,
        warmup=1,
        baseline_bytes=on_device,
        timeline=options.timeline is not None,
        keep_results=True,
    )
    report = RunReport(
        model=start.model,
        backend=backend.name,
        device=str(device),
        weights_bytes=weights,
        embedding_dim=None,
        measurement=measurement,
        quant=options.quant,
        full_weights_bytes=full_weights,
        kept_8bit=kept,
        kept_8bit_linears=len(kept_linears),
        kept_8bit_bytes=weights_bytes(kept_linears),
        storage_dtype=options.storage_dtype,
        offload=options.offload,
        device_weights_bytes=on_device,
        kind=kind,
        quality_metric=type(job).quality_metric,
        budget_bytes=options.budget,
        budgeted=budgeted,
    )
    if loaded is not None:
        report.load_seconds, report.load_peak_bytes = loaded.seconds, loaded.peak_bytes
        report.load_peak_rss_bytes = loaded.peak_rss_bytes
        if changes and options.reference:
            reference = _reference(job, folder, device, full_weights)
    job.fill(report, list(measurement.results), reference)  # what the timed calls returned
    if options.timeline is not None:
        title = f"{Path(report.model).name if options.model else 'all-MiniLM-L6-v2'}, {report.changes or 'as loaded'}, on {device}"
        report.timeline_path = str(
            measurement.timeline.plot(
                options.timeline,
                title=title,
                budget_bytes=report.budget_bytes,
                predicted_peak_bytes=report.predicted_peak_bytes,
            )
        )
    return report


def _described(options: RunOptions, folder: Path) -> str:
    """The model as a report names it: its folder, or the built-in default."""
    return str(folder) if options.model is not None else "all-MiniLM-L6-v2 (built-in default)"


def _job(
    kind: str, folder: Path, device: torch.device, options: RunOptions, backend: backends.Backend, skeleton: Any = None
) -> Job:
    """The run's job for a folder of ``kind`` (:mod:`tightfit.kinds`)."""
    return get_kind(kind).job_class()(folder, device, options, backend, skeleton)


def _full_weights_bytes(plan: Any) -> int:
    """The weights as the checkpoint holds them: every unit's bytes before the plan."""
    return sum(entry.bytes_before for entry in plan.entries)


def _reference(job: Job, folder: Path, device: torch.device, full_bytes: int) -> Any:
    """What the full-precision model produces, for quality: loaded after the measured run,
    only where it takes at most half the memory the machine has free (else None)."""
    free = backends.get("cpu").memory(torch.device("cpu")).free
    if free is None or full_bytes > free // 2:
        return None
    fitted = job.model
    job.model = type(job).load_full(folder, device)
    try:
        return job.result()
    finally:
        job.model = fitted


def _convert(model: torch.nn.Module, options: RunOptions, device: torch.device) -> tuple[str, ...]:
    """Quantize, cast and offload as ``options`` say; returns the layers a 4-bit quant kept in 8 bits."""
    kept: tuple[str, ...] = ()
    if options.quant is not None:
        config = quant_configs()[options.quant]
        if options.keep_8bit and isinstance(config, NF4Config):
            stack = layer_stack(model)
            kept = stack[len(stack) // 2 :]
            config = replace(config, keep_8bit=kept)
        if isinstance(config, COMPUTE_CONFIGS):
            config = replace(config, compute=options.compute)
        quantize_(model, config)
    if options.storage_dtype is not None:
        compute_dtype = next(model.parameters()).dtype
        apply_layerwise_casting(model, STORAGE_DTYPE_CHOICES[options.storage_dtype], compute_dtype)
    if options.offload is not None:
        apply_offloading(model, device, offload_to=options.offload)
    return kept


def weights_bytes(modules: list[torch.nn.Module]) -> int:
    """The weights' bytes that ``tightfit run`` reports: parameters and buffers of ``modules``,
    plus what their quantized layers hold outside those (scales and maps:
    :func:`tightfit.quant.unregistered_tensors`); a tensor they share counts once."""
    check_type("modules", modules, (list, tuple))
    for index, module in enumerate(modules):
        check_type(f"modules[{index}]", module, torch.nn.Module)
    tensors = []
    for root in modules:
        tensors += list(root.parameters()) + list(root.buffers()) + unregistered_tensors(root)
    return tensor_bytes(tensors)


__getattr__ = renamed(
    __name__,
    QUANT_CONFIGS=("quant_configs()", quant_configs),
    STORAGE_DTYPES=("STORAGE_DTYPE_CHOICES", lambda: STORAGE_DTYPE_CHOICES),
)
