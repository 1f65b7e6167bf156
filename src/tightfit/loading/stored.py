"""How a checkpoint holds its quantized weights (private to ``tightfit.loading``): which
leaves are stored quantized and how, read from the checkpoint's own entries (a leaf's
``weight.quant_state.bitsandbytes__nf4``, ``SCB``, ...) and checked against the config's
bitsandbytes ``quantization_config`` or a saved plan (D9)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tightfit._validate import check_choice, check_non_negative_number, check_type
from tightfit.fitting import FitPlan
from tightfit.loading.folder import _CONFIG_DTYPES, read_config
from tightfit.loading.safetensors import Checkpoint
from tightfit.quant import Linear4bit, Linear8bit, LinearInt8, storage_format
from tightfit.quant.state import PACKED_KEY_8BIT, PACKED_KEY_PREFIX

__all__ = [
    "COMPUTE_DTYPE",
    "MODULES",
    "PLAN_FILE",
    "STATE_KEYS",
    "StoredLeaf",
    "check_bitsandbytes",
    "check_plan_names",
    "check_planned",
    "holds_quantized",
    "bitsandbytes_settings",
    "stored_layout",
    "stored_storages",
    "swap_modules",
]

#: The plan :func:`tightfit.save` writes beside the checkpoint, and :func:`tightfit.load` follows.
PLAN_FILE = "tightfit-plan.json"
#: The entry (after a leaf's checkpoint name) that says how the leaf is stored, and the storage that reads it.
_MARKERS = {
    f"weight.{PACKED_KEY_PREFIX}nf4": "nf4",
    f"weight.{PACKED_KEY_PREFIX}fp4": "fp4",
    f"weight.{PACKED_KEY_8BIT}": "8bit",
    "SCB": "int8",
    "weight_scale": "float8",
}
#: Entries of a quantized leaf other than its markers: the quant state's tensors and what the modules write.
STATE_KEYS = ("weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map")
_OTHER_KEYS = ("weight", "bias", "weight_format")
#: The module each quantized storage's entries load into.
MODULES = {"nf4": Linear4bit, "fp4": Linear4bit, "8bit": Linear8bit, "int8": LinearInt8}
#: Names bitsandbytes' ``bnb_4bit_quant_storage`` takes, and the dtypes of the packed weights they mean.
_QUANT_STORAGE = {"uint8": torch.uint8, "int8": torch.int8, **_CONFIG_DTYPES}
#: Name of the hook that runs a 4-bit layer in bitsandbytes' ``bnb_4bit_compute_dtype``.
COMPUTE_DTYPE = "tightfit.compute_dtype"


@dataclass(frozen=True)
class StoredLeaf:
    """A Linear or Embedding of the model as the checkpoint stores it: ``base`` is its name
    there, ``storage`` the catalogue's name for how (``keep``: plainly), ``marker`` the
    entry that says so, ``keys`` all its entries."""

    name: str
    base: str
    storage: str
    marker: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class _Bitsandbytes:
    """What a bitsandbytes ``quantization_config`` says about the checkpoint."""

    storage: str  # "nf4", "fp4" or "int8"
    nested: bool
    quant_storage: torch.dtype
    compute_dtype: torch.dtype
    threshold: float


def stored_storages() -> tuple[str, ...]:
    """The storages a leaf's checkpoint entries can say it is in: those loading reads back as stored."""
    return ("keep", *dict.fromkeys(_MARKERS.values()))


def holds_quantized(folder: Path) -> bool:
    """Whether the folder's weights are stored quantized: a plan saved beside them, or a
    ``quantization_config`` in its config.json (the config as checked and read once per
    version of the file)."""
    return (folder / PLAN_FILE).is_file() or getattr(read_config(folder), "quantization_config", None) is not None


def bitsandbytes_settings(config: object, where: str) -> _Bitsandbytes:
    """The checked settings of a ``quantization_config`` (the defaults are transformers' ``BitsAndBytesConfig``'s)."""
    if not isinstance(config, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(config).__name__}")
    method = config.get("quant_method")
    if method != "bitsandbytes":
        raise ValueError(f"{where}.quant_method={method!r} is not accepted; accepted: 'bitsandbytes'")
    four, eight = config.get("load_in_4bit", False), config.get("load_in_8bit", False)
    if not isinstance(four, bool) or not isinstance(eight, bool) or four == eight:
        raise ValueError(
            f"{where} has load_in_4bit={four!r} and load_in_8bit={eight!r}; accepted: exactly one of them true"
        )
    threshold = check_non_negative_number(f"{where}.llm_int8_threshold", config.get("llm_int8_threshold", 6.0))
    if eight:
        return _Bitsandbytes("int8", False, torch.uint8, torch.float32, threshold)
    quant_type = config.get("bnb_4bit_quant_type", "fp4")
    check_choice(f"{where}.bnb_4bit_quant_type", quant_type, ("nf4", "fp4"))
    nested = config.get("bnb_4bit_use_double_quant", False)
    check_type(f"{where}.bnb_4bit_use_double_quant", nested, bool)
    quant_storage = config.get("bnb_4bit_quant_storage", "uint8")
    check_choice(f"{where}.bnb_4bit_quant_storage", quant_storage, tuple(_QUANT_STORAGE))
    compute = config.get("bnb_4bit_compute_dtype") or "float32"
    check_choice(f"{where}.bnb_4bit_compute_dtype", compute, tuple(_CONFIG_DTYPES))
    return _Bitsandbytes(quant_type, nested, _QUANT_STORAGE[quant_storage], _CONFIG_DTYPES[compute], threshold)


def stored_layout(model: nn.Module, checkpoint: Checkpoint) -> dict[str, StoredLeaf]:
    """Every Linear and Embedding of ``model`` as ``checkpoint`` stores it. A leaf marked
    twice, a marker on a leaf its storage does not take (a GPT-2 ``Conv1D``), or a
    quantization entry of no leaf is a ValueError naming the entry."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    layout, claimed = {}, set()
    for name, module in model.named_modules():
        if type(module) not in (nn.Linear, nn.Embedding):
            continue
        weight = checkpoint.find([f"{name}.weight"], prefix)
        if weight is None:
            continue  # reported missing, with the others, when the checkpoint is matched to the model
        base = weight.removesuffix(".weight")
        suffixes = (*_MARKERS, *STATE_KEYS, *_OTHER_KEYS)
        keys = tuple(f"{base}.{suffix}" for suffix in suffixes if f"{base}.{suffix}" in checkpoint.entries)
        markers = [f"{base}.{suffix}" for suffix in _MARKERS if f"{base}.{suffix}" in checkpoint.entries]
        if len(markers) > 1:
            raise ValueError(f"checkpoint entries {markers[0]!r} and {markers[1]!r} store {name} in two ways")
        storage = _MARKERS[markers[0].removeprefix(f"{base}.")] if markers else "keep"
        if storage == "keep" and not checkpoint.entries[weight].dtype.is_floating_point:
            raise ValueError(
                f"checkpoint entry {weight!r} is {checkpoint.entries[weight].dtype}, but no entry says how it is "
                f"quantized; accepted: one of {', '.join(f'{base}.{suffix}' for suffix in _MARKERS)}"
            )
        if type(module) not in storage_format(storage).leaf_types:
            raise ValueError(
                f"checkpoint entry {markers[0]!r} stores {name}, a {type(module).__name__}, as {storage}; "
                f"{storage} is read for {', '.join(t.__name__ for t in storage_format(storage).leaf_types)} only"
            )
        layout[name] = StoredLeaf(name, base, storage, markers[0] if markers else weight, keys)
        claimed.update(keys)
    quantizing = tuple(f".{suffix}" for suffix in (*_MARKERS, *STATE_KEYS, "weight_format"))
    stray = [key for key in checkpoint.entries if key not in claimed and key.endswith(quantizing)]
    if stray:
        raise ValueError(
            f"checkpoint entry {stray[0]!r} quantizes a tensor of no Linear or Embedding of {type(model).__name__}; "
            f"quantized weights are read for those only"
        )
    return layout


def check_bitsandbytes(layout: dict[str, StoredLeaf], settings: _Bitsandbytes, checkpoint: Checkpoint) -> None:
    """Every quantized leaf is stored as the config says; at least one is."""
    quantized = [leaf for leaf in layout.values() if leaf.storage != "keep"]
    if not quantized:
        raise ValueError(
            f"{checkpoint.folder}/config.json's quantization_config says bitsandbytes {settings.storage}, but its "
            f"checkpoint holds no quantized weight (no weight.quant_state.* or SCB entries)"
        )
    for leaf in quantized:
        if leaf.storage != settings.storage:
            raise ValueError(
                f"checkpoint entry {leaf.marker!r} stores {leaf.name} as {leaf.storage}; config.json's "
                f"quantization_config says {settings.storage}"
            )
        if settings.storage == "int8":
            continue
        nested = f"{leaf.base}.weight.nested_absmax" in checkpoint.entries
        if nested != settings.nested:
            raise ValueError(
                f"checkpoint entry {leaf.base}.weight.nested_absmax is {'present' if nested else 'absent'}, but "
                f"quantization_config has bnb_4bit_use_double_quant={settings.nested}"
            )
        packed = checkpoint.entries[f"{leaf.base}.weight"].dtype
        if packed != settings.quant_storage:
            raise ValueError(
                f"checkpoint entry {leaf.base}.weight has dtype {packed}; quantization_config has "
                f"bnb_4bit_quant_storage {settings.quant_storage}"
            )


def check_plan_names(plan: FitPlan, model: nn.Module, source: str) -> None:
    """Every module ``plan`` names (its units, their leaves) is one of ``model``'s, and no
    unit is decided twice: a ValueError naming ``source`` (the plan file) and the module where not."""
    modules = dict(model.named_modules())
    decided: set[str] = set()
    for entry in plan.entries:
        for name in (*entry.modules, *entry.leaves):
            if name not in modules:
                raise ValueError(
                    f"{source} names module {name!r} (in unit {entry.module!r}), which the {type(model).__name__} "
                    f"built from the folder's config does not have; accepted: a plan made for this model"
                )
        for name in entry.modules:
            if name in decided:
                raise ValueError(f"{source} decides for module {name!r} twice; accepted: one entry per unit")
            decided.add(name)


def check_planned(layout: dict[str, StoredLeaf], plan: FitPlan, model: nn.Module, source: str) -> None:
    """Every leaf is stored as ``plan`` says: its storage where the plan names the leaf and
    the storage takes it, plainly elsewhere."""
    check_plan_names(plan, model, source)
    modules = dict(model.named_modules())
    planned = {}
    for entry in plan.entries:
        storage = storage_format(entry.storage)
        for leaf in entry.leaves if storage.decodes else ():
            if leaf not in modules:
                raise ValueError(f"{source} names leaf {leaf!r} in unit {entry.module!r}; {plan.model} has none")
            if type(modules[leaf]) in storage.leaf_types:
                planned[leaf] = storage.name
    for leaf in layout.values():
        expected = planned.get(leaf.name, "keep")
        if leaf.storage != expected:
            raise ValueError(
                f"checkpoint entry {leaf.marker!r} stores {leaf.name} as {leaf.storage}; {source} says {expected}"
            )


def swap_modules(model: nn.Module, modules: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """Put each of ``modules`` in place of the model's module of that name; returns those it replaced."""
    replaced = {}
    for name, module in modules.items():
        owner, _, child = name.rpartition(".")
        parent = model.get_submodule(owner)
        replaced[name] = parent._modules[child]
        parent._modules[child] = module
    return replaced
