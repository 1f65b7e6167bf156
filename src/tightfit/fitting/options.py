"""What the planner chooses between: the model's units (one per layer of its repeated
stack, one per Linear / Embedding outside it, and the rest), and for each unit the
options (storage x placement) with their predicted device bytes and seconds.

Storages are the formats of the storage catalogue (:func:`tightfit.quant.storage_formats`):
each declares its bytes for a weight's shape (stored, held on the device when offloaded,
allocated while computing), its precision rank and its decode cost's figure; this module
iterates them and names none. Biases, norms and other tensors keep their dtype.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tightfit.fitting.outliers import assumed_outliers
from tightfit.hooks._units import compile_patterns
from tightfit.hooks.casting import dtype_deciders, model_pins
from tightfit.memory import tensor_bytes
from tightfit.ops import FEW_TOKENS
from tightfit.quant import StorageFormat, layer_stack, storage_format, storage_formats
from tightfit.quant.layers import largest_repeated_list

if TYPE_CHECKING:
    from tightfit.fitting.calibration import Calibration

__all__ = [
    "PLACEMENTS",
    "TIED_DECODE",
    "TIME_TOLERANCE",
    "Option",
    "Unit",
    "find_units",
    "options_for",
    "storage_names",
    "with_decode",
]

#: Where a unit's weights live between forwards, in the order the planner prefers them.
PLACEMENTS = ("device", "cpu", "disk")
#: Predicted times closer than this (relative) count as a tie, which the more precise
#: storage and then the earlier placement win: the time model's figures are measured on a
#: machine doing other work, and a plan must not change with their noise.
TIME_TOLERANCE = 0.25

#: Why a unit of tied weights is kept in its dtype (placed anywhere, stored as it is): a
#: quantized format replaces one leaf's module and leaves the other leaf the full-precision
#: tensor, a second copy; float8 storage is applied leaf by leaf (the storage catalogue), and
#: the second leaf would meet a weight that is float8 already, without its scale.
TIED_DECODE = "its leaves share one weight (tied), which only storage kept as it is serves to both"

_PAGE = 4096  # bytes the OS reads per touched page of a memory-mapped file
_TIE = 1e-10  # seconds per unit of noise: breaks ties between options of equal cost only


def storage_names() -> tuple[str, ...]:
    """The storages the planner may choose, in its order of preference at equal time:
    the names of the storage catalogue's formats."""
    return tuple(storage.name for storage in storage_formats())


@dataclass(frozen=True)
class Unit:
    """A group of modules the planner decides for as one.

    ``weights``: the qualified names of its ``nn.Linear`` and ``nn.Embedding`` leaves, with
    (shape, dtype); ``bytes``: all its tensors as they are; ``rows``: rows each leaf
    computed in the traced forward (tokens for an embedding); ``fixed``: the reason it
    must stay as it is, or ""; ``no_cast``: the reason storages that cast a weight in place
    (float8) are ruled out, or ""; ``tied``: the leaves whose weight an earlier leaf of the
    unit holds (tied weights: stored once, used by each); ``no_decode``: the reason storages
    that decode are ruled out (:data:`TIED_DECODE`), or "";
    ``buffer_bytes``: of ``bytes``, its buffers that hold values already (a skeleton's
    constructors compute them: rotary frequencies, position ids; a checkpoint is not read
    into them), so they are in memory before the first unit streams in; a buffer on the
    meta device is read with its unit.
    ``active_share``: the share of the unit's weights a one-token forward reads: an
    expert's (a list's, or the stacked experts') is the router's top-k over the number of
    experts; 1 for any other unit.
    ``converted``: its tensors that the checkpoint stores in another dtype than the
    model's (``stored_dtypes`` of :func:`find_units`): loading reads and converts them,
    so the unit cannot be mapped from the checkpoint in place; ``read_bytes``: the largest
    of those as stored, alive beside its converted copy while it is read.
    """

    name: str
    kind: str  # "layer", "block" (part of one), "expert", "linear", "embedding" or "rest"
    weights: tuple[tuple[str, str, tuple[int, ...], torch.dtype], ...]  # (name, type, shape, dtype)
    bytes: int
    other_bytes: int  # tensors in the unit that are not leaf weights (biases, norms)
    fixed: str = ""  # why it must stay as it is, where it is ("" when free)
    no_cast: str = ""  # why storages that cast in place are ruled out ("" when they are not)
    tied: tuple[str, ...] = ()  # leaves whose weight an earlier leaf holds (counted there)
    no_decode: str = ""  # why storages that decode are ruled out ("" when they are not)
    buffer_bytes: int = 0  # of bytes, its buffers: computed by the skeleton, alive before loading starts
    converted: tuple[str, ...] = ()  # tensors stored in another dtype than the model's: read and converted
    read_bytes: int = 0  # the largest of those as stored, beside its converted copy while it is read
    active_share: float = 1.0  # of its weights, the share one token reads (an expert: top-k of the experts)

    def takes(self, storage: StorageFormat) -> bool:
        """Whether ``storage`` applies to a leaf of this unit: one of its leaf types, in a
        floating-point dtype; a storage that casts in place not where ``no_cast`` says; none
        that decodes where ``no_decode`` says."""
        if storage.decodes and self.no_decode:
            return False
        kinds = {leaf_type.__name__ for leaf_type in storage.leaf_types}
        floats = any(
            kind in kinds and dtype in (torch.float32, torch.float16, torch.bfloat16)
            for _, kind, _, dtype in self.weights
        )
        return floats and not (storage.casts and self.no_cast)


@dataclass(frozen=True)
class Option:
    """One way to hold a unit: its bytes held on the device between forwards; the device's
    activation bytes while it computes with decoded weights (activations alive then,
    inputs, the largest decoded copy; 0 when nothing is decoded); the bytes copied onto
    the device for each forward; and its predicted seconds per forward.

    ``cost`` is what the search minimizes: ``seconds``, except that a storage never
    counts as faster than a more precise one (a lower rank in the storage catalogue) at
    the same placement or on the device, so that weights lose precision only to meet the
    budget, never for speed alone, nor than an option the planner prefers (listed
    earlier) that it does not beat by more than :data:`TIME_TOLERANCE`; plus a tie-break
    for quantization noise (1e-10 s per weight times its format's ``noise``), so that at
    equal cost the most precise storage stays. ``error_energy``: its weights' squared
    expected errors summed (numel x the format's ``noise`` squared): the quality term
    (:mod:`tightfit.fitting.quality`).
    """

    storage: str
    placement: str
    stored_bytes: int  # the unit's bytes in this storage, wherever they live
    held_bytes: int  # of those, held in the device's memory between forwards
    compute_peak_bytes: int  # activations + inputs + decoded copy while its leaves compute
    onload_bytes: int  # copied onto the device for each forward (offloaded to cpu/disk, accelerators)
    seconds: float
    cost: float
    load_bytes: int = 0  # above held, while this unit streams in from a checkpoint and converts (on the host)
    ready_bytes: int = 0  # alive before streaming starts (the skeleton's buffers: Unit.buffer_bytes), when loading
    error_energy: float = 0.0  # sum of numel x noise**2 over its stored weights

    @property
    def transient_bytes(self) -> int:
        """The most this option adds above held bytes at one moment: computing or loading."""
        return max(self.compute_peak_bytes, self.load_bytes)


def _tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    return {id(t): t for t in [*module.parameters(), *module.buffers()]}


def _owners(root: nn.Module) -> dict[int, int]:
    """How many modules under ``root`` (shared modules once) hold each tensor directly."""
    owners: dict[int, int] = {}
    for module in root.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                owners[id(tensor)] = owners.get(id(tensor), 0) + 1
    return owners


def _buffer_bytes(modules: list[nn.Module], tensors: dict[int, torch.Tensor]) -> int:
    """Bytes of those of ``tensors`` (by id) that are buffers of ``modules`` or their
    submodules and hold values already: a buffer on the meta device is read from the
    checkpoint with its unit (a pre-quantized layer's packed weight and scales, which its
    module registers as buffers), not computed before loading starts."""
    buffers = {id(buffer) for module in modules for buffer in module.buffers() if not buffer.is_meta}
    return tensor_bytes(tensor for key, tensor in tensors.items() if key in buffers)


def _conversions(
    tensors: dict[int, torch.Tensor], names: dict[int, list[str]], stored: Mapping[str, torch.dtype]
) -> dict[str, int]:
    """Of ``tensors`` (by id), those ``stored`` (by any of their ``names``) in another dtype
    than their own: each one's first name and its bytes as stored."""
    found = {}
    for key, tensor in tensors.items():
        dtype = next((stored[name] for name in names.get(key, ()) if name in stored), tensor.dtype)
        if dtype != tensor.dtype:
            found[names[key][0]] = tensor.numel() * dtype.itemsize
    return found


def _stored_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters and buffers."""
    return tensor_bytes(_tensors(module).values())


#: How finely a layer of the stack is cut into units: whole (``"layers"``), or into its
#: attention, its feed-forward network and each expert of a mixture of experts (``"blocks"``).
UNIT_SIZES = ("layers", "blocks")


def layer_names(model: nn.Module) -> tuple[str, ...]:
    """The model's stack of repeated layers: by their ``nn.Linear`` weights, else by bytes (GPT-2's Conv1D)."""
    return layer_stack(model) or largest_repeated_list(model, _stored_bytes)


def _holds_weights(module: nn.Module) -> bool:
    """Whether ``module`` holds a matrix or more (a norm's vector is not worth a unit)."""
    return any(parameter.dim() >= 2 for parameter in module.parameters())


def _stacked_experts(module: nn.Module) -> int:
    """How many experts ``module`` holds stacked: the first dimension of its parameters of
    three dimensions or more (expert x rows x columns), in a module of the model's own (a
    convolution's kernels are not experts); 0 for any other module."""
    if type(module).__module__.startswith("torch.nn."):
        return 0
    return next((int(p.shape[0]) for p in module.parameters(recurse=False) if p.dim() >= 3), 0)


def _experts(module: nn.Module) -> bool:
    """Whether ``module`` is a mixture of experts: a child holds its experts (a list of
    modules of one type, or stacked in one module: parameters of three dimensions), as many
    as a sibling router scores (a Linear's outputs, or the rows of a child's own matrix)."""
    children = list(module.children())
    routes = {child.out_features for child in children if isinstance(child, nn.Linear)}
    routes |= {p.shape[0] for child in children for p in child.parameters(recurse=False) if p.dim() == 2}
    for child in children:
        listed = isinstance(child, nn.ModuleList) and len(child) > 1 and len({type(c) for c in child}) == 1
        if listed and _holds_weights(child) and len(child) in routes:
            return True
        stacked = _stacked_experts(child)
        if stacked and stacked in routes:
            return True
    return False


def _blocks(name: str, layer: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``layer``'s parts that hold weights, each a unit: its attention and its feed-forward
    network (``"block"``; each of a list of them); in a mixture of experts, each expert of
    a list, or the module holding them stacked (``"expert"``), and its router and shared
    parts (``"block"``). Norms stay with the rest of the model."""
    parts = []
    for child_name, child in layer.named_children():
        if not _holds_weights(child):
            continue
        qualified = f"{name}.{child_name}"
        if isinstance(child, nn.ModuleList):  # blocks listed (T5's self-attention, cross-attention, feed-forward)
            parts.extend((f"{qualified}.{index}", "block", block) for index, block in enumerate(child))
            continue
        if not _experts(child):
            parts.append((qualified, "block", child))
            continue
        for part_name, part in child.named_children():
            inner = f"{qualified}.{part_name}"
            if isinstance(part, nn.ModuleList) and _holds_weights(part):
                parts.extend((f"{inner}.{index}", "expert", expert) for index, expert in enumerate(part))
            elif _stacked_experts(part):
                parts.append((inner, "expert", part))
            elif _holds_weights(part):
                parts.append((inner, "block", part))
    return parts


def _active_share(model: nn.Module, name: str) -> float:
    """The share of an expert unit's weights one token reads: the top-k its mixture routes
    each token to (``top_k`` or ``num_experts_per_tok`` of the mixture, its router or the
    model's config) over its number of experts; 1 where either is not found."""
    parts = name.split(".")
    module = model.get_submodule(name)
    experts = _stacked_experts(module)
    if experts:
        parts = parts[:-1]  # the stacked experts' module sits in the mixture
    else:
        experts, parts = len(model.get_submodule(".".join(parts[:-1]))), parts[:-2]  # a list's expert
    mixture = model.get_submodule(".".join(parts))
    config = getattr(model, "config", None)
    for holder in (mixture, *mixture.children(), config):
        top_k = next((getattr(holder, key) for key in ("top_k", "num_experts_per_tok") if hasattr(holder, key)), None)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and 0 < top_k:
            return min(1.0, top_k / experts)
    return 1.0


def _groups(model: nn.Module, unit_size: str = "layers") -> list[tuple[str, str, nn.Module]]:
    stack = set(layer_names(model))
    groups: list[tuple[str, str, nn.Module]] = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        if any(name == prefix or name.startswith(prefix + ".") for prefix in inside):
            continue
        if name in stack:
            parts = _blocks(name, module) if unit_size == "blocks" else []
            groups.extend(parts or [(name, "layer", module)])
            inside.add(name)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and isinstance(
            getattr(module, "weight", None), torch.Tensor
        ):
            groups.append((name, "linear" if isinstance(module, nn.Linear) else "embedding", module))
            inside.add(name)
    return groups


def _tied_groups(groups: list[tuple[str, str, nn.Module]]) -> list[list[tuple[str, str, nn.Module]]]:
    """``groups`` joined where Linear / Embedding groups share a tensor (tied weights), the
    joined ones first; each list in module order."""
    parent = list(range(len(groups)))

    def root(index: int) -> int:
        while parent[index] != index:
            index = parent[index]
        return index

    first: dict[int, int] = {}  # tensor id -> the first group holding it
    for index, (_, kind, module) in enumerate(groups):
        for key in _tensors(module) if kind in ("linear", "embedding") else ():
            if key in first:
                low, high = sorted((root(index), root(first[key])))
                parent[high] = low
            else:
                first[key] = index
    joined: dict[int, list[tuple[str, str, nn.Module]]] = {}
    for index, group in enumerate(groups):
        joined.setdefault(root(index), []).append(group)
    return sorted(joined.values(), key=lambda members: len(members) == 1)  # stable


def find_units(
    model: nn.Module, stored_dtypes: Mapping[str, torch.dtype] | None = None, unit_size: str = "layers"
) -> list[Unit]:
    """The model's units: units of tied weights first, then the others in module order, the rest last.

    ``unit_size`` (:data:`UNIT_SIZES`): each layer of the stack one unit, or its parts
    (:func:`_blocks`): attention, feed-forward network, each expert.

    Linear and Embedding modules outside the layer stack that share a weight (tied weights:
    GPT-2's ``transformer.wte`` and ``lm_head``) are one unit, named after the first of
    them in module order, whose leaves are all of them: a plan entry's leaves outside its
    module are the unit's other modules (:attr:`~tightfit.fitting.PlanEntry.modules`). The
    shared weight is stored once and each leaf's use counts in the unit's time; it may move
    off the device but keeps its dtype (:data:`TIED_DECODE`). Tied units come first because
    offloading one hooks their common parent, which must not hold offloaded units yet.
    A unit that holds a tensor some module outside it holds too stays as it is (a layer
    tied to something else, a tensor a norm shares); the tensor counts in the first unit
    that holds it. A leaf the model pins to full precision (diffusers'
    ``_keep_in_fp32_modules`` and ``_skip_layerwise_casting_patterns``, searched in
    qualified names as layerwise casting does) is not one of its unit's leaves: its weight
    keeps its dtype, wherever the unit is placed. ``stored_dtypes``: the dtype a checkpoint
    stores each tensor in, by qualified name (:func:`tightfit.loading.stored_dtypes`, from
    its headers); a tensor stored in another dtype than the model's is read and converted
    while loading (:attr:`Unit.converted`).
    """
    owners = _owners(model)
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)

    def loading(modules: list[nn.Module], tensors: dict[int, torch.Tensor]) -> dict[str, Any]:
        """:class:`Unit`'s loading terms (``buffer_bytes``, ``converted``, ``read_bytes``)
        for a unit of ``modules`` holding ``tensors``."""
        found = _conversions(tensors, names, stored_dtypes or {})
        return {
            "buffer_bytes": _buffer_bytes(modules, tensors),
            "converted": tuple(found),
            "read_bytes": max(found.values(), default=0),
        }

    deciders = dtype_deciders(model)  # model.dtype reads them: layerwise casting leaves them as they are
    pins = compile_patterns("pins", model_pins(model))
    units, covered = [], {}
    for members in _tied_groups(_groups(model, unit_size)):
        name, kind, _ = members[0]
        modules = [module for _, _, module in members]
        tensors = {key: t for module in modules for key, t in _tensors(module).items()}
        inner: dict[int, int] = {}
        for module in modules:
            for key, count in _owners(module).items():
                inner[key] = inner.get(key, 0) + count
        if any(inner[key] < owners[key] for key in tensors):
            own = {k: v for k, v in tensors.items() if k not in covered}
            size = tensor_bytes(own.values())
            why = "shares a tensor with a module outside it (tied weights)"
            units.append(Unit(name, kind, (), size, size, why, **loading(modules, own)))
            covered.update(tensors)
            continue
        leaves = [
            (f"{group}.{leaf_name}" if leaf_name else group, leaf)
            for group, _, module in members
            for leaf_name, leaf in module.named_modules()
            if type(leaf) in (nn.Linear, nn.Embedding)
        ]
        leaves = [(leaf_name, leaf) for leaf_name, leaf in leaves if not any(pin.search(leaf_name) for pin in pins)]
        weights = tuple(
            (leaf_name, type(leaf).__name__, tuple(leaf.weight.shape), leaf.weight.dtype) for leaf_name, leaf in leaves
        )
        firsts = {id(leaf.weight): leaf_name for leaf_name, leaf in reversed(leaves)}
        tied = tuple(leaf_name for leaf_name, leaf in leaves if firsts[id(leaf.weight)] != leaf_name)
        no_cast = "model.dtype reads its weight, which must keep its dtype" if firsts.keys() & deciders else ""
        no_decode = TIED_DECODE if any(inner[key] > 1 for key in firsts) else ""  # another module of it holds one
        other = tensor_bytes(v for k, v in tensors.items() if k not in firsts)
        size = tensor_bytes(tensors.values())
        share = _active_share(model, name) if kind == "expert" else 1.0
        units.append(
            Unit(
                name,
                kind,
                weights,
                size,
                other,
                "",
                no_cast,
                tied,
                no_decode,
                **loading(modules, tensors),
                active_share=share,
            )
        )
        covered.update(tensors)
    rest = {k: v for k, v in _tensors(model).items() if k not in covered}
    if rest:
        size = tensor_bytes(rest.values())
        why = "norms, biases and buffers outside the units"
        units.append(Unit("(rest)", "rest", (), size, size, why, **loading([model], rest)))
    return units


def options_for(
    unit: Unit,
    *,
    storages: frozenset[str],
    placements: frozenset[str],
    device: torch.device,
    rows: dict[str, int],
    live: dict[str, int],
    figures: Calibration,
    outliers: dict[str, int] | None = None,
    call_rows: dict[str, int] | None = None,
    loading: bool = False,
    one_token: bool = False,
    page_cached: bool = False,
) -> list[Option]:
    """The options of ``unit`` that ``storages`` and ``placements`` allow, each with bytes and seconds.

    ``rows``: rows each leaf computed in the traced forward (summed over calls: its time);
    ``call_rows``: the most rows of one of its calls (the buffers a forward allocates
    exist per call; default ``rows``, for a leaf called once); ``live``:
    the most activation and input bytes alive while each leaf computes (its own output
    included); ``figures``: the time model's figures; ``outliers``: input columns each
    Linear's outlier path takes (:func:`~tightfit.fitting.outliers.observe_outliers`),
    or None where not observed (then :func:`~tightfit.fitting.outliers.assumed_outliers`).
    A unit of tied weights stores the shared weight once and counts each leaf's use of it:
    the LM head reads every row per forward, the embedding the rows it looks up; offloaded
    on an accelerator, each leaf's forward copies it onto the device.
    ``loading``: the plan covers streaming the unit in from a checkpoint on this (host)
    device: each option's ``load_bytes`` (:func:`_load_bytes`). ``one_token``: ``rows``
    are a one-token forward's (a decode step), which reads an expert's weights only where
    the token is routed to it (:attr:`Unit.active_share`). ``page_cached``: the host's page
    cache holds what is mapped from disk, so a unit there reads it at the figures'
    ``cached_read_bandwidth`` (what reading mapped pages costs above reading memory), not
    at ``disk_bandwidth``.
    """
    if unit.fixed:
        storages, placements = frozenset({"keep"}), frozenset({"device"})
    on_host = device.type == "cpu"
    # one token reads its routed experts' weights only (a mapped file: only their pages); a prompt reads them all
    share = unit.active_share if one_token else 1.0
    options = []
    for storage in storage_formats():
        if storage.name not in storages or (storage.decodes and not unit.takes(storage)):
            continue
        kinds = {leaf_type.__name__ for leaf_type in storage.leaf_types}
        stored, held_offloaded, decoded, decode_seconds, compute_seconds = unit.other_bytes, 0, 0, 0.0, 0.0
        touched, noise, energy, converting, shrunk = int(unit.other_bytes * share), 0.0, 0.0, 0, 0
        read, token_seconds = touched, 0.0  # bytes read from memory per forward; few-token leaves' seconds
        again = 0  # tied leaves' weights: stored with the first leaf, copied onto the device again for each use
        for name, kind, shape, dtype in unit.weights:
            leaf = storage if kind in kinds else storage_format("keep")  # a leaf the storage does not apply to stays
            size = leaf.stored_bytes(shape, dtype)
            if name in unit.tied:
                again += size - leaf.held_offloaded(shape, dtype)
            else:
                stored += size
                held_offloaded += leaf.held_offloaded(shape, dtype)
            numel, count = math.prod(shape), rows.get(name, 0)
            per_weight = figures.token_seconds.get(str(dtype).removeprefix("torch."), {}).get(leaf.name)
            few_tokens = kind == "Linear" and 0 < count <= FEW_TOKENS and per_weight is not None
            if few_tokens:  # the few-token kernels' measured seconds, reading and decoding included
                token_seconds += share * numel * per_weight
                touched += int(share * size)
            elif kind == "Linear":
                compute_seconds += share * 2 * numel * count / figures.matmul_flops
                touched += int(share * size)
                read += int(share * size)
            else:  # an embedding kept as it is reads only the rows it looks up (whole pages from a file)
                looked_up = min(size, count * max(size // shape[0], _PAGE)) if not leaf.decodes else size
                touched += looked_up
                read += looked_up
            if leaf.decodes:  # leaves convert in module order: those before this one hold their stored bytes
                converting = max(converting, size + leaf.convert_bytes(shape, dtype) - shrunk)
                shrunk += numel * dtype.itemsize - size
                noise += numel * leaf.noise
                energy += numel * leaf.noise**2
                decode_seconds += 0.0 if few_tokens else share * numel * figures.decode_seconds[leaf.name]
                columns = 0
                if leaf.outlier_threshold is not None:
                    columns = assumed_outliers(shape[1]) if outliers is None else outliers.get(name, 0)
                one_call = count if call_rows is None else call_rows.get(name, count)
                decoded = max(decoded, live.get(name, 0) + leaf.transient_bytes(shape, one_call, columns, dtype))
        for placement in PLACEMENTS:
            if placement not in placements or (placement == "cpu" and on_host):
                continue
            held = stored if placement == "device" else held_offloaded
            seconds = compute_seconds + decode_seconds + token_seconds + read / figures.device_bandwidth
            onload = 0
            if placement != "device" and not on_host:
                onload = stored - held
                seconds += (onload + again) / figures.host_to_device_bandwidth
            if placement == "disk" and on_host and page_cached:
                seconds += touched * max(0.0, 1 / figures.cached_read_bandwidth - 1 / figures.device_bandwidth)
            elif placement == "disk":
                seconds += (touched if on_host else stored + again) / figures.disk_bandwidth
            options.append(
                Option(
                    storage.name,
                    placement,
                    stored,
                    held,
                    decoded,
                    onload,
                    seconds,
                    _cost(seconds, storage.rank, placement, options) + _TIE * noise,
                    _load_bytes(unit, storage, placement, converting, held) if loading and on_host else 0,
                    unit.buffer_bytes if loading and on_host else 0,
                    energy,
                )
            )
    return options


def with_decode(prefill: Option, decode: Option, steps: int) -> Option:
    """``prefill`` (an option priced for the traced forward) with ``steps`` one-token
    forwards of the same option (``decode``) added to its time and cost; its bytes held are
    the same, and it computes at the larger of the two peaks."""
    return replace(
        prefill,
        seconds=prefill.seconds + steps * decode.seconds,
        cost=prefill.cost + steps * decode.cost,
        compute_peak_bytes=max(prefill.compute_peak_bytes, decode.compute_peak_bytes),
    )


def _load_bytes(unit: Unit, storage: StorageFormat, placement: str, converting: int, held: int) -> int:
    """Bytes above ``held`` while the unit streams in: its tensors as read, plus the larger
    of: at the worst leaf, that leaf's converted copy and scratch less what the leaves
    converted before it gave back (``converting``); a tensor stored in another dtype, as
    read, beside its copy in the model's dtype (``Unit.read_bytes``). A unit kept as it is
    on disk is mapped from the checkpoint in place, and reads nothing into memory, unless
    a tensor of it is stored in another dtype: then it is read, converted and written to
    an offload file like a quantized unit on disk."""
    if placement == "disk" and not storage.decodes and not unit.converted:
        return 0
    return max(0, unit.bytes + max(converting, unit.read_bytes) - held)


def _cost(seconds: float, rank: int, placement: str, earlier: list[Option]) -> float:
    """``seconds``, raised to the time of an option the planner prefers (listed earlier)
    that this one does not beat by more than :data:`TIME_TOLERANCE`, and to the time of
    every more precise option at the same placement or on the device: weights lose
    precision only to meet the budget, never for speed alone, and noise in the figures
    does not decide between options of about equal time."""
    ranks = {storage.name: storage.rank for storage in storage_formats()}
    floor = 0.0
    for option in earlier:
        more_precise = ranks[option.storage] < rank and option.placement in (placement, "device")
        if more_precise or seconds * (1 + TIME_TOLERANCE) >= option.seconds:
            floor = max(floor, option.seconds)
    return max(seconds, floor)
