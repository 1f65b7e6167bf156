"""``tightfit.save``: a fitted model as a folder that :func:`tightfit.load` reads back as
it is, with no calibration and no conversion.

The folder holds the model's state dict in safetensors (quantized layers in the
bitsandbytes / transformers layout their modules write; float8 weights as stored, with
their row scales; offloaded units' tensors from wherever they live), sharded above
``max_shard_size``; its config.json; the tokenizer and generation files of the folder it
came from; and the plan, as JSON, in ``tightfit-plan.json``. Loading it follows that
plan: each leaf is checked to be stored as the plan says, and read as stored.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from torch import nn

from tightfit._validate import check_type
from tightfit.fitting import FitPlan, parse_size
from tightfit.loading.folder import require
from tightfit.loading.safetensors import DTYPES, INDEX_FILE, SINGLE_FILE
from tightfit.loading.stored import PLAN_FILE, stored_storages
from tightfit.quant import FLOAT8_DTYPE, storage_format

__all__ = ["save"]

#: Files of a model folder besides its weights and config that a saved folder keeps: the
#: tokenizer's, generation defaults, chat templates.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _check_applied(model: nn.Module, plan: FitPlan) -> None:
    """Every leaf the plan stores compactly is stored so in ``model`` (the plan was applied,
    or the model loaded into it), and every storage is one loading reads back."""
    modules = dict(model.named_modules())
    readable = stored_storages()
    for entry in plan.entries:
        storage = storage_format(entry.storage)
        if entry.storage not in readable:
            raise ValueError(
                f"plan stores unit {entry.module!r} as {entry.storage}, which tightfit.load does not read back; "
                f"accepted: {', '.join(readable)}"
            )
        for leaf in entry.leaves if storage.decodes else ():
            module = modules.get(leaf)
            if module is None:
                raise ValueError(f"model has no module {leaf!r}, which the plan stores as {entry.storage}")
            if type(module) in storage.leaf_types and module.weight.dtype != FLOAT8_DTYPE:
                raise ValueError(
                    f"model's {leaf} is a full-precision {type(module).__name__}, but the plan stores it as {entry.storage}: apply the "
                    f"plan first (plan.apply(model)), or save the model tightfit.load made with it"
                )


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict, a tied tensor (one registered in several modules) once, under its
    first name: loading fills every module holding it. Other tensors sharing memory are
    written each under its own name."""
    registered = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    first: dict[int, str] = {}
    tied = {name for name, tensor in registered if first.setdefault(id(tensor), name) != name}
    tensors = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_meta:
            raise ValueError(f"model's {name} is on the meta device: load the weights before saving")
        if name not in tied:
            tensors[name] = tensor.detach()
    return tensors


def _write_shard(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One safetensors file, written tensor by tensor (each copied to the CPU on its own):
    an 8-byte header length, the JSON header padded to 8 bytes, then the data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise ValueError(f"model's {name} has dtype {tensor.dtype}, which safetensors files here do not hold")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with open(file, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors.values():
            data = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
            handle.write(memoryview(data.numpy()))


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, cut into groups of at most ``limit`` bytes (a bigger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save(
    model: nn.Module,
    plan: FitPlan,
    folder: str | Path,
    *,
    source: str | Path | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write ``model`` (a transformers model with ``plan`` carried out: loaded by
    :func:`tightfit.load`, or ``plan.apply``-ed) to ``folder`` (new, or empty), which
    :func:`tightfit.load` then reads with ``plan`` and no budget: every stored tensor
    loads as it is, and the outputs are bit-identical to ``model``'s. ``source``: the
    folder the model came from, whose tokenizer and generation files are copied.
    ``max_shard_size``: bytes per safetensors file (an int or a size such as ``"2GB"``).
    The plan must cover loading (``covers_load``), so that loading the folder back is
    within its budget. Returns the folder."""
    check_type("model", model, nn.Module)
    check_type("plan", plan, FitPlan)
    check_type("folder", folder, (str, Path))
    limit = parse_size(max_shard_size, "max_shard_size")
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_file", None)):
        raise TypeError(
            f"model must be a transformers model (with a .config to write as config.json), got {type(model).__name__}"
        )
    if plan.model != type(model).__name__:
        raise ValueError(f"plan was made for {plan.model}, but model is a {type(model).__name__}")
    if not plan.covers_load:
        raise ValueError(
            "plan does not cover loading: make it with tightfit.load or fit(..., loading=True), so that loading "
            "the saved folder stays within its budget"
        )
    if source is not None:
        check_type("source", source, (str, Path))
        if not Path(source).is_dir():
            raise ValueError(f"source={str(source)!r} is not a folder; pass the model folder the model came from")
    target = Path(folder)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"folder={str(folder)!r} exists and is not an empty folder; save into a new or empty one")
    _check_applied(model, plan)
    tensors = _state(model)
    require("transformers")
    target.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, limit)
    if len(shards) == 1:
        _write_shard(target / SINGLE_FILE, shards[0])
    else:
        weight_map = {}
        for number, shard in enumerate(shards, 1):
            name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(target / name, shard)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (target / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
    config.to_json_file(target / "config.json", use_diff=True)
    for name in TOKENIZER_FILES if source is not None else ():
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, target / name)
    (target / PLAN_FILE).write_text(plan.to_json(), encoding="utf-8")
    return target
