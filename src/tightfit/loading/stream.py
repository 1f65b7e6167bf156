"""``tightfit.load``: plan a local model folder from its config (and its checkpoint's
headers: the dtype each tensor is stored in) before reading a byte of a weight, then
stream its safetensors checkpoint into that plan, unit by unit (D8).

Each unit of the plan is read tensor by tensor into the skeleton's meta parameters,
converted to its planned storage (the storage catalogue's ``apply``: quantize, cast) and
put where the plan says (kept on the device; offloaded to CPU memory or to a disk file,
which frees the host copy at once). The full-precision model never exists: what is alive
at once is the weights held so far plus one unit as read and converting, which is what a
plan made with ``loading=True`` predicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit._progress import muted, task
from tightfit._validate import check_type
from tightfit.backends.resolve import resolve_backend
from tightfit.fitting import Allow, Calibration, FitPlan, fit, parse_size
from tightfit.fitting.execute import PlanExecutor
from tightfit.fitting.plan import PlanEntry
from tightfit.hooks._disk import MappedRegions
from tightfit.kinds import get_kind
from tightfit.loading.folder import model_folder, model_kind, skeleton
from tightfit.loading.safetensors import INDEX_FILE, SINGLE_FILE, Checkpoint
from tightfit.loading.stored import check_plan_names, holds_quantized
from tightfit.quant import storage_format

__all__ = ["default_inputs", "load", "on_meta", "plan_folder", "stored_dtypes", "stream"]

#: Tokens per sequence of the inputs a folder is planned for when none are given.
DEFAULT_TOKENS = 128


def default_inputs(config: Any, kind: str) -> dict[str, torch.Tensor]:
    """The inputs a folder is planned for when none are given, on the meta device: the
    kind's batch (:class:`tightfit.kinds.ModelKind`: one prompt for a causal LM, 8
    sequences for an encoder) of 128 tokens each (fewer where the model's
    ``max_position_embeddings`` is smaller), with an attention mask where the kind has one."""
    entry = get_kind(kind)
    limit = getattr(config, "max_position_embeddings", None)
    tokens = min(DEFAULT_TOKENS, limit) if isinstance(limit, int) and limit > 0 else DEFAULT_TOKENS
    shape = (entry.batch, tokens)
    inputs = {"input_ids": torch.zeros(shape, dtype=torch.long, device="meta")}
    if entry.attention_mask:
        inputs["attention_mask"] = torch.ones(shape, dtype=torch.long, device="meta")
    if entry.decoder_inputs:
        start = getattr(config, "decoder_start_token_id", None) or 0
        inputs["decoder_input_ids"] = torch.full((entry.batch, 1), start, dtype=torch.long, device="meta")
    return inputs


def on_meta(inputs: Any) -> Any:
    """``inputs`` (a tensor, or tensors in a dict, tuple or list) on the meta device: what a skeleton is planned for."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to("meta")
    if isinstance(inputs, Mapping):
        return {key: on_meta(value) for key, value in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(on_meta(value) for value in inputs)
    return inputs


def _headers(folder: Path) -> Checkpoint | None:
    """The folder's checkpoint, its shards' headers read and checked (no weight byte is
    read), where it holds one with every shard; None where it holds none yet (config.json
    and the tokenizer only, or an index whose shards are not all there)."""
    if not (folder / SINGLE_FILE).is_file():
        index = folder / INDEX_FILE
        if not index.is_file() or not all(shard.is_file() for shard in Checkpoint._shards(folder, index)):
            return None
    return Checkpoint(folder)


def _stored_dtypes(model: nn.Module, checkpoint: Checkpoint | None) -> dict[str, torch.dtype]:
    """:func:`stored_dtypes` from a checkpoint whose headers are read ({} for None)."""
    if checkpoint is None:
        return {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    found = {}
    for names in _Slots(model).names.values():
        source = checkpoint.find(names, prefix)
        if source is not None:
            found.update(dict.fromkeys(names, checkpoint.entries[source].dtype))
    return found


def stored_dtypes(model: nn.Module, folder: str | Path) -> dict[str, torch.dtype]:
    """The dtype the folder's safetensors checkpoint stores each of ``model``'s meta
    tensors in (``model``: the folder's skeleton), under every name the model knows it by,
    read from the shards' headers: no weight byte is read. What :func:`tightfit.fit` takes
    as ``stored_dtypes`` to count the conversion of a tensor stored in another dtype than
    the model's. Empty where the folder holds no checkpoint yet (config.json and the
    tokenizer, or an index whose shards are not all there): the plan then assumes the
    model's dtypes. A tensor the checkpoint lacks is left out (loading refuses it)."""
    check_type("model", model, nn.Module)
    return _stored_dtypes(model, _headers(model_folder(folder)))


def _plan_folder(
    folder: str | Path,
    budget: int | str,
    *,
    example_inputs: Any,
    backend: Any,
    allow: Allow | Mapping[str, Any] | None,
    calibration: Calibration | None,
    kind: str | None,
    max_error: float | str | None = None,
    units: str = "layers",
) -> tuple[nn.Module, FitPlan, Checkpoint | None]:
    """:func:`plan_folder`, and the checkpoint whose headers it read (None where the folder holds none yet)."""
    model, config = skeleton(folder, kind)  # the folder checked first
    checkpoint = _headers(Path(folder))
    inputs = default_inputs(config, kind or model_kind(config)) if example_inputs is None else on_meta(example_inputs)
    plan = fit(
        model,
        inputs,
        budget,
        backend=backend,
        allow=allow,
        calibration=calibration,
        loading=True,
        stored_dtypes=_stored_dtypes(model, checkpoint),
        max_error=max_error,
        units=units,
    )
    return model, plan, checkpoint


def plan_folder(
    folder: str | Path,
    budget: int | str,
    *,
    example_inputs: Any = None,
    backend: Any = None,
    allow: Allow | Mapping[str, Any] | None = None,
    calibration: Calibration | None = None,
    kind: str | None = None,
    max_error: float | str | None = None,
    units: str = "layers",
) -> tuple[nn.Module, FitPlan]:
    """(skeleton, plan): the plan of a local Hugging Face folder for ``budget``, covering
    loading, made from its config.json and, where the folder holds its safetensors
    checkpoint, the dtypes its headers give each tensor (:func:`stored_dtypes`; no weight
    byte is read: a tensor stored in another dtype than the config's is counted as read
    and converted). ``example_inputs`` (default :func:`default_inputs`) are moved to the
    meta device; the other arguments are :func:`tightfit.fit`'s. Raises
    :class:`tightfit.FitError` when nothing fits: before loading, naming the smallest
    peak reachable and what dominates it."""
    model, plan, _ = _plan_folder(
        folder,
        budget,
        example_inputs=example_inputs,
        backend=backend,
        allow=allow,
        calibration=calibration,
        kind=kind,
        max_error=max_error,
        units=units,
    )
    return model, plan


def load(
    folder: str | Path,
    budget: int | str | None = None,
    *,
    plan: FitPlan | None = None,
    example_inputs: Any = None,
    backend: Any = None,
    allow: Allow | Mapping[str, Any] | None = None,
    calibration: Calibration | None = None,
    kind: str | None = None,
    model: nn.Module | None = None,
    max_error: float | str | None = None,
    units: str = "layers",
) -> tuple[nn.Module, FitPlan]:
    """(model, plan): a local Hugging Face folder's model, streamed into a plan for ``budget``.

    The plan is made first, from the config and the checkpoint's headers
    (:func:`plan_folder`; ``FitError`` before any weight is read when nothing fits), or
    given as ``plan`` (then ``budget``, ``example_inputs``, ``allow``, ``calibration``,
    ``max_error`` and ``units`` are refused, and a ``backend`` must be the plan's device:
    it is checked, not planned for; ``max_error`` and ``units`` are
    :func:`tightfit.fit`'s, ``max_error`` refused for a checkpoint stored quantized,
    whose storage is not the planner's to choose). The safetensors
    checkpoint is then read unit by unit, each unit converted and placed as planned, in
    the dtype the checkpoint's config names (``torch_dtype``). ``kind``: ``"causal-lm"``
    (with its LM head) or ``"encoder"`` (the base model); default: the config's. ``model``:
    with ``plan``, the skeleton it was made on (:func:`plan_folder`), filled in place;
    default: a new one from the config. Building a skeleton allocates each parameter's
    empty tensor for a moment (address space, never written) before moving it to meta.
    Returns the model in eval mode, on the plan's device.
    """
    path = model_folder(folder)
    if plan is not None:
        check_type("plan", plan, FitPlan)
        given = [
            name
            for name, value in (
                ("budget", budget),
                ("example_inputs", example_inputs),
                ("allow", allow),
                ("calibration", calibration),
                ("max_error", max_error),
                ("units", None if units == "layers" else units),
            )
            if value is not None
        ]
        if given:
            raise ValueError(f"plan is given, so {', '.join(given)} would be ignored; pass either a plan or a budget")
    from tightfit.loading import prequantized  # a cycle: it reads with this module's helpers

    if holds_quantized(path):  # bitsandbytes, or tightfit.save: the stored tensors go in as they are
        if max_error is not None:
            raise ValueError(
                f"max_error={max_error!r} bounds what the planner's storage choices lose, but {path} is stored "
                f"quantized already: the planner chooses only where its tensors live; drop max_error"
            )
        return prequantized.load_quantized(
            path,
            budget,
            plan=plan,
            example_inputs=example_inputs,
            backend=backend,
            allow=allow,
            calibration=calibration,
            kind=kind,
            model=model,
            units=units,
        )
    checkpoint, given = None, plan is not None
    if given:
        if model is None:
            model, _ = skeleton(path, kind)
        check_type("model", model, nn.Module)
        if plan.model != type(model).__name__:
            raise ValueError(f"plan was made for {plan.model}, but {path} holds a {type(model).__name__}")
        if not plan.covers_load:
            raise ValueError(
                "plan does not cover loading: make it with tightfit.load, plan_folder or fit(..., loading=True)"
            )
        check_plan_names(plan, model, "the plan given")
    else:
        if budget is None:
            raise ValueError("budget is needed to plan the load (bytes or a size such as '6GB'), or pass plan")
        if model is not None:
            raise ValueError("model (a skeleton) is taken only with the plan made on it; pass plan too")
        model, plan, checkpoint = _plan_folder(
            path,
            parse_size(budget, "budget"),
            example_inputs=example_inputs,
            backend=backend,
            allow=allow,
            calibration=calibration,
            kind=kind,
            max_error=max_error,
            units=units,
        )
    # a plan made here names the device the planner resolved; a given one is resolved on this machine
    device = _plan_device(plan, backend) if given else torch.device(plan.device)
    stream(model, checkpoint if checkpoint is not None else Checkpoint(path), plan, device)  # the headers planned
    return model, plan


class _Slots:
    """Every meta tensor of a skeleton and the (module, name) slots holding it: a tied
    tensor sits in several, and its real value must go into each."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors: dict[int, torch.Tensor] = {}  # by id; held, so that the ids stay theirs
        self.names: dict[int, list[str]] = {}
        self.places: dict[int, list[tuple[nn.Module, str]]] = {}
        for owner_name, module in model.named_modules(remove_duplicate=False):
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None or not tensor.is_meta:
                        continue
                    key = id(tensor)
                    self.tensors[key] = tensor
                    qualified = f"{owner_name}.{name}" if owner_name else name
                    if qualified not in self.names.setdefault(key, []):
                        self.names[key].append(qualified)
                    if (module, name) not in self.places.setdefault(key, []):
                        self.places[key].append((module, name))

    def fill(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Put ``value`` in every slot that holds the meta ``tensor`` (a parameter stays one);
        the slots are forgotten, so a module that quantizing replaces is freed with its weight."""
        if isinstance(tensor, nn.Parameter):
            value = nn.Parameter(value, requires_grad=tensor.requires_grad)
        for module, name in self.places.pop(id(tensor)):
            table = module._parameters if name in module._parameters else module._buffers
            table[name] = value


def _sources(model: nn.Module, slots: _Slots, checkpoint: Checkpoint) -> dict[int, str]:
    """The checkpoint name of every meta tensor, each checked against its entry's shape
    and dtype kind before a byte is read; a ValueError names what is missing or wrong."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    sources, missing = {}, []
    for key, names in slots.names.items():
        found = checkpoint.source(names, prefix)
        if found is None:
            missing.append(names[0])
            continue
        sources[key] = found
        entry = checkpoint.entries[found]
        expected = slots.tensors[key]
        if tuple(expected.shape) != entry.shape:
            raise ValueError(
                f"checkpoint tensor {found!r} has shape {entry.shape}; the model's {names[0]} takes {tuple(expected.shape)}"
            )
        if expected.is_floating_point() != entry.dtype.is_floating_point:
            raise ValueError(
                f"checkpoint tensor {found!r} has dtype {entry.dtype}; the model's {names[0]} is {expected.dtype}"
            )
    if missing:
        used = set(sources.values())
        unknown = [name for name in checkpoint.entries if name not in used]
        layout = (
            f"; it holds {len(unknown)} tensors the model does not name ({', '.join(unknown[:3])} ...): a layout "
            f"transformers converts while loading (a mixture of experts stored expert by expert), which tightfit "
            f"does not stream; save the model again with save_pretrained(folder, save_original_format=False)"
            if unknown
            else ""
        )
        raise ValueError(
            f"the checkpoint in {checkpoint.folder} lacks {len(missing)} of the model's tensors: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}{layout}"
        )
    return sources


def _read_unit(module: nn.Module, checkpoint: Checkpoint, slots: _Slots, sources: dict[int, str], advance: Any) -> None:
    """Read every meta tensor under ``module`` into place, in its skeleton's dtype."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta:  # not read already (a tied tensor, or a unit's that holds it too)
            _read_into(tensor, sources[id(tensor)], checkpoint, slots, advance)


def _read_into(tensor: torch.Tensor, source: str, checkpoint: Checkpoint, slots: _Slots, advance: Any) -> None:
    value = checkpoint.read(source)
    advance(value.nbytes)
    slots.fill(tensor, value if value.dtype == tensor.dtype else value.to(tensor.dtype))


def _converts(module: nn.Module, checkpoint: Checkpoint, sources: dict[int, str]) -> bool:
    """Whether the checkpoint stores a meta tensor of ``module`` in another dtype than the
    skeleton's: the unit is then read and converted, not mapped in place (the plan counts
    it so, from the same headers: :attr:`tightfit.fitting.options.Unit.converted`)."""
    return any(
        tensor.is_meta and checkpoint.entries[sources[id(tensor)]].dtype != tensor.dtype
        for tensor in [*module.parameters(), *module.buffers()]
    )


def _map_unit(
    module: nn.Module, name: str, checkpoint: Checkpoint, slots: _Slots, sources: dict[int, str], advance: Any
) -> list[MappedRegions]:
    """Fill the unit's meta tensors with views of the checkpoint's files, mapped in place
    (one map per shard the unit spans). Only for a unit whose tensors are stored in the
    skeleton's dtypes (not :func:`_converts`)."""
    regions: dict[Path, dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]] = {}
    pending = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.is_meta:
            continue
        source = sources[id(tensor)]
        entry = checkpoint.entries[source]
        if entry.dtype != tensor.dtype:  # the callers read such a unit instead
            raise ValueError(f"checkpoint tensor {source!r} is {entry.dtype}, not {tensor.dtype}: it cannot be mapped")
        checkpoint.check(source)
        regions.setdefault(entry.file, {})[source] = (entry.start, entry.nbytes, entry.dtype, entry.shape)
        pending.append((tensor, entry.file, source))
    files = {path: MappedRegions(path, name, found, checkpoint.stamp(path)) for path, found in regions.items()}
    for tensor, path, source in pending:
        slots.fill(tensor, files[path].tensors[source])
        advance(checkpoint.entries[source].nbytes)
    return list(files.values())


def _stream_entry(
    executor: PlanExecutor,
    entry: PlanEntry,
    checkpoint: Checkpoint,
    slots: _Slots,
    sources: dict[int, str],
    advance: Any,
) -> None:
    """Read ``entry``'s unit into place, and have ``executor`` store and place it. A unit
    kept as it is on disk is mapped from the checkpoint in place (each of its modules: a
    unit of tied weights computes from the one shared view) where its tensors are stored
    in the skeleton's dtypes; any other unit is read (and converted), then stored and
    placed: a quantized unit on disk is written to an offload file."""
    model = executor.model
    names = entry.modules if entry.kind != "rest" else ("",)
    modules = [model.get_submodule(name) for name in names]
    as_stored = (
        entry.kind != "rest"
        and entry.placement == "disk"
        and not storage_format(entry.storage).decodes
        and not any(_converts(module, checkpoint, sources) for module in modules)
    )
    if as_stored:
        mapped = [
            file
            for name, module in zip(names, modules)
            for file in _map_unit(module, name, checkpoint, slots, sources, advance)
        ]
        executor.place(entry, mapped)
        return
    for module in modules:
        _read_unit(module, checkpoint, slots, sources, advance)
    executor.store(entry)
    executor.place(entry)


def _plan_device(plan: FitPlan, backend: Any) -> torch.device:
    """The device a plan used as it is loads onto: its own; a ValueError where this
    machine lacks it or ``backend`` names another (a budget plans placements for that)."""
    if backend is not None:
        wanted = resolve_backend(backend).device
        if str(wanted) != plan.device:
            raise ValueError(
                f"backend={backend!r} is {wanted}, but the plan is for {plan.device}; pass budget too, to plan "
                f"placements for {wanted}, or leave backend out"
            )
        return wanted
    try:
        return resolve_backend(plan.device).device
    except (ValueError, RuntimeError) as error:
        raise ValueError(
            f"the plan is for {plan.device}, which this machine cannot use ({error}); pass budget to plan "
            f"placements for this machine"
        ) from None


def _check_filled(model: nn.Module, plan: FitPlan) -> None:
    """A ValueError where a tensor of ``model`` is still on meta: ``plan`` (a saved one,
    edited or made for another model) has no unit holding it."""
    left = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if left is not None:
        raise ValueError(f"plan covers no unit holding {left!r}; it was made for another model than {plan.model}")


def stream(model: nn.Module, checkpoint: Checkpoint, plan: FitPlan, device: torch.device) -> None:
    """Read ``checkpoint`` into ``model`` (a skeleton on meta) unit by unit as ``plan``
    says, each unit stored and placed by the plan's executor as soon as it is read
    (:class:`~tightfit.fitting.execute.PlanExecutor`, which ``FitPlan.apply`` runs too)."""
    slots = _Slots(model)
    sources = _sources(model, slots, checkpoint)
    total = sum(checkpoint.entries[name].nbytes for name in set(sources.values()))
    executor = PlanExecutor(model, plan, device)
    with task(f"reading and converting {len(plan.entries)} units", total) as advance, muted():
        for entry in executor.entries:
            _stream_entry(executor, entry, checkpoint, slots, sources, advance)
    _check_filled(model, plan)
    executor.finish()
    model.eval()
