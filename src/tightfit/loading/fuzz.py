"""Hostile model folders: the hostile-input cases of the loaders (D7, D9).

Five targets, in turn: a safetensors file read by :class:`~tightfit.loading.Checkpoint`
(generated tensors, then mutated headers: names given twice, gaps, overlaps, bytes
before the first tensor or after the last, a byte-order mark, deep nesting, values of
the wrong type, huge numbers, NaN, lone surrogates, lengths that lie, files cut short);
a sharded checkpoint's ``model.safetensors.index.json``; ``config.json`` (the values
that broke transformers without naming the key, and random mutations of a valid Llama
config); the ``tightfit-plan.json`` of a folder :func:`tightfit.save` wrote; and the
bitsandbytes ``quantization_config`` of a prequantized folder. The last four run
:func:`tightfit.load` on a tiny Llama.

Each case ends in one outcome. "equal": the folder loaded and computes exactly what the
reference does (a header: tightfit read what the safetensors library reads; a config:
what transformers builds from it, with the LM head where ``architectures`` names a causal
LM). "clean": a ValueError, TypeError or OSError (or one of tightfit's own errors).
"refused": a valid case raised. "unclean": any other exception. "wrong": a case loaded
and differs from its reference, or a header the safetensors library refuses was read.
``python -m tightfit.loading.fuzz --count N`` runs cases in worker processes
(:mod:`tightfit._fuzz_campaign`), so a crash or a hang is blamed on its case.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import random
import shutil
import struct
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tightfit._errors import BackendConflictError, StrictModeError
from tightfit._fuzz_campaign import main
from tightfit.hooks import OffloadFileError

__all__ = ["CLEAN", "TARGETS", "LoaderCase", "make_case", "run_case"]

TARGETS = ("header", "index", "config", "plan", "bitsandbytes")
#: What a hostile folder may raise: D7's errors, and tightfit's own (FitError is a ValueError).
CLEAN = (ValueError, TypeError, OSError, OffloadFileError, StrictModeError, BackendConflictError)
IDS = torch.arange(1, 9).unsqueeze(0)
BUDGET = 100_000_000


class Raw(str):
    """JSON text put into a document as it is (NaN, deep nesting, a huge literal)."""


def dumps(value: Any) -> str:
    """JSON text of ``value`` where :class:`Raw` parts stay as written and a list of
    :class:`Pairs` writes an object whose keys may repeat."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{dumps(key)}:{dumps(item)}" for key, item in value) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(key)}:{dumps(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(item) for item in value) + "]"
    return json.dumps(value)


class Pairs(list):
    """A JSON object as (key, value) pairs: a key may be given twice."""


def _deep(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


#: Values of the wrong type or out of any range, for any field.
_HOSTILE = (
    "x",
    "",
    -1,
    0,
    1.5,
    True,
    None,
    [],
    [1],
    {},
    {"a": 1},
    10**30,
    2**63,
    2**64,
    Raw("1" + "0" * 5000),
    Raw("NaN"),
    Raw("-Infinity"),
    _deep(50),
    _deep(3000),
)
#: Mutations of a whole JSON document's text.
_TEXT_DAMAGE = ("bom", "deep", "truncate", "utf8", "empty", "nan", "duplicate", "utf16")


def _damage_text(text: bytes, how: str, rng: random.Random) -> bytes:
    if how == "bom":
        return b"\xef\xbb\xbf" + text
    if how == "deep":
        return b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    if how == "truncate":
        return text[: rng.randrange(len(text))] if text else text
    if how == "utf8":
        position = rng.randrange(max(len(text), 1))
        return text[:position] + b"\xff" + text[position + 1 :]
    if how == "empty":
        return b""
    if how == "nan":
        return text[:-1] + b', "nan_value": NaN}'
    if how == "utf16":
        return text.decode("utf-8", "replace").encode("utf-16")
    return text[:-1] + b"," + text[1:]  # duplicate: every key given twice


# -- references, built once per process --------------------------------------------------------


def calibration() -> Any:
    """Fixed figures (no measuring), so a case plans the same in every process."""
    from tightfit.fitting import Calibration

    return Calibration.fixed(device_name="fuzz")


@functools.cache
def _workspace() -> Path:
    holder = tempfile.TemporaryDirectory(prefix="tightfit-loading-fuzz-")
    _KEEP.append(holder)  # removed when the process ends
    return Path(holder.name)


_KEEP: list[Any] = []


def _outputs(model: Any) -> torch.Tensor:
    with torch.inference_mode():
        out = model(IDS)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).detach().float()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


@functools.cache
def base() -> tuple[Path, torch.Tensor]:
    """A tiny Llama (vocabulary 256, two layers) saved by transformers, and its logits."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = _workspace() / "base"
    model.save_pretrained(folder)
    return folder, _outputs(model)


@functools.cache
def sharded() -> Path:
    """The tiny Llama's checkpoint in two shards and their index."""
    from safetensors.torch import save_file

    from tightfit.loading import Checkpoint

    folder = _workspace() / "sharded"
    source, _ = base()
    shutil.copytree(source, folder)
    checkpoint = Checkpoint(folder)
    names = sorted(checkpoint.entries)
    halves = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    weight_map = {}
    for file, part in halves.items():
        save_file({name: checkpoint.read(name) for name in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors").unlink()
    total = sum(entry.nbytes for entry in checkpoint.entries.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


@functools.cache
def saved() -> tuple[Path, torch.Tensor]:
    """The tiny Llama loaded into a plan (nf4 layers and head, the embedding mapped from
    disk) and saved by :func:`tightfit.save`, and its logits."""
    import tightfit

    source, _ = base()
    model, plan = tightfit.load(
        source,
        200_000,
        example_inputs={"input_ids": IDS},
        calibration=calibration(),
        allow={"storage": ["keep", "nf4"]},
        max_error=1.0,  # 4-bit past the default bound: the saved folder must hold quantized weights
    )
    folder = tightfit.save(model, plan, _workspace() / "saved", source=source)
    return folder, _outputs(model)


#: What transformers writes for a model quantized with load_in_4bit, nf4 (as ``saved()`` stores it).
BNB_CONFIG = {
    "quant_method": "bitsandbytes",
    "load_in_4bit": True,
    "load_in_8bit": False,
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": False,
    "bnb_4bit_compute_dtype": "float32",
    "bnb_4bit_quant_storage": "uint8",
    "llm_int8_threshold": 6.0,
    "llm_int8_skip_modules": None,
    "llm_int8_has_fp16_weight": False,
    "llm_int8_enable_fp32_cpu_offload": False,
}


@functools.cache
def prequantized() -> tuple[Path, torch.Tensor]:
    """The saved folder as a bitsandbytes one: no plan, a ``quantization_config``."""
    source, expected = saved()
    folder = _workspace() / "bitsandbytes"
    shutil.copytree(source, folder)
    (folder / "tightfit-plan.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": BNB_CONFIG}, indent=2))
    return folder, expected


@contextlib.contextmanager
def _copy(folder: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="case-", dir=_workspace()) as scratch:
        target = Path(scratch) / folder.name
        shutil.copytree(folder, target)
        yield target


# -- safetensors headers -------------------------------------------------------------------------

_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
_TENSOR_NAMES = ("w", "model.layers.0.mlp.up_proj.weight", "a.b", "é", "x" * 40, "__meta")
#: Mutations of a header that keep it valid.
BENIGN = ("padding", "space_before", "metadata_ok", "name_ok")
HEADER_MUTATIONS = (
    "duplicate",
    "gap",
    "lead",
    "trailing",
    "overlap",
    "bom",
    "deep",
    "metadata",
    "field",
    "drop_field",
    "extra_field",
    "name",
    "length",
    "truncate",
    "nonobject",
    "byte",
    "huge",
    *BENIGN,
)


def _generate_tensors(rng: random.Random) -> list[list]:
    tensors = []
    for number in range(rng.randint(0, 4)):
        dtype = rng.choice(sorted(_ITEMSIZE))
        shape = [rng.choice((0, 1, 2, 3, 5)) for _ in range(rng.randint(0, 3))]
        size = math.prod(shape) * _ITEMSIZE[dtype]
        data = bytes(rng.randrange(2) for _ in range(size)) if dtype == "BOOL" else rng.randbytes(size)
        tensors.append([f"{rng.choice(_TENSOR_NAMES)}{number}", dtype, shape, data])
    return tensors


def draw_header(rng: random.Random) -> dict[str, Any]:
    """A header case: tensors (name, dtype, shape, bytes), the order of their bytes and of
    their keys, and zero to three mutations."""
    tensors = _generate_tensors(rng)
    count = len(tensors)
    mutations = []
    for _ in range(rng.choice((0, 1, 1, 1, 2, 3))):
        kind = rng.choice(HEADER_MUTATIONS)
        mutations.append((kind, rng.randrange(max(count, 1)), rng.randrange(1 << 30)))
    return {
        "tensors": tensors,
        "data_order": rng.sample(range(count), count),
        "key_order": rng.sample(range(count), count),
        "metadata": rng.choice([None, {"format": "pt"}]),
        "mutations": mutations,
    }


def build_header(case: dict[str, Any]) -> tuple[bytes, dict[str, tuple[str, list, bytes]]]:
    """The file's bytes, and the tensors a reader must find (those of an unmutated header)."""
    tensors = copy.deepcopy(case["tensors"])
    offsets, data, position = {}, b"", 0
    for index in case["data_order"]:
        offsets[index] = [position, position + len(tensors[index][3])]
        data += tensors[index][3]
        position += len(tensors[index][3])
    entries: list[list] = []
    for index in case["key_order"]:
        name, dtype, shape, _ = tensors[index]
        entries.append([name, {"dtype": dtype, "shape": shape, "data_offsets": offsets[index]}])
    metadata: Any = case["metadata"]
    prefix, suffix, length_change, cut = b"", b"", None, 0
    for kind, which, number in case["mutations"]:
        rng = random.Random(number)
        entry = entries[which % len(entries)][1] if entries else None
        entry = entry if isinstance(entry, dict) and _offsets(entry) is not None else None
        laid = [e for _, e in entries if isinstance(e, dict) and _offsets(e) is not None]
        if kind == "duplicate" and entries:
            twin = copy.deepcopy(entries[which % len(entries)][1] if rng.random() < 0.5 else rng.choice(entries)[1])
            entries.append([entries[which % len(entries)][0], twin])
        elif kind == "gap" and entry is not None:
            gap = rng.randint(1, 16)
            begin = entry["data_offsets"][1]
            for other in laid:
                if other["data_offsets"][0] >= begin and other is not entry:
                    other["data_offsets"] = [other["data_offsets"][0] + gap, other["data_offsets"][1] + gap]
            data = data[:begin] + rng.randbytes(gap) + data[begin:]
        elif kind == "lead":
            lead = rng.randint(1, 16)
            for other in laid:
                other["data_offsets"] = [other["data_offsets"][0] + lead, other["data_offsets"][1] + lead]
            data = rng.randbytes(lead) + data
        elif kind == "trailing":
            data += rng.randbytes(rng.randint(1, 16))
        elif kind == "overlap" and entry is not None and len(laid) > 1:
            other = rng.choice([e for e in laid if e is not entry])
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            entry["data_offsets"] = [other["data_offsets"][0], other["data_offsets"][0] + size]
        elif kind == "bom":
            prefix = b"\xef\xbb\xbf"
        elif kind == "deep":
            nested = _deep(rng.choice((40, 1500, 100_000)))
            where = rng.choice(("metadata", "extra", "top", "shape"))
            if where == "metadata":
                metadata = {"a": nested}
            elif where == "shape" and entry is not None:
                entry["shape"] = nested
            elif where == "extra" and entry is not None:
                entry["deep"] = nested
            else:
                entries.append(["deep", nested])
        elif kind == "metadata":
            metadata = rng.choice([[], "x", 1, {"a": 1}, {"a": {"b": "c"}}, {"a": None}, Raw('{"\\ud800": "x"}')])
        elif kind == "metadata_ok":
            metadata = rng.choice([None, {}, {"a": "b", "total": "3"}])
        elif kind == "field" and entry is not None:
            field = rng.choice(("dtype", "shape", "data_offsets"))
            pool = {
                "dtype": ["F99", "f32", 4, None, ["F32"], "F4", "C128"],
                "shape": ["2", [1.0], [-1], [True], [[1]], None, {"0": 1}, [2**64]],
                "data_offsets": [[0], [0, 1, 2], "0,4", [0.0, 4], [-1, 3], [4, 0], None, [True, 1]],
            }[field]
            entry[field] = rng.choice(pool + [rng.choice(_HOSTILE)])
        elif kind == "drop_field" and entry is not None:
            entry.pop(rng.choice(("dtype", "shape", "data_offsets")), None)
        elif kind == "extra_field" and entry is not None:
            entry["extra"] = rng.choice([1, "x", None, []])
        elif kind == "name" and entries:
            entries[which % len(entries)][0] = rng.choice(["__metadata__", Raw('"\\ud800"'), Raw('"\\udc00x"')])
        elif kind == "name_ok" and entries:
            entries[which % len(entries)][0] = rng.choice(["", "\u0000", "名前", " "]) + str(which)
        elif kind == "length":
            length_change = rng.choice([1, 7, -1, -5, "zero", "max", "huge", "file"])
        elif kind == "truncate":
            cut = rng.randint(1, 64)
        elif kind == "nonobject":
            entries, metadata = [["__whole__", Raw(rng.choice(["[]", "null", "1", '"x"', "[{}]"]))]], None
        elif kind == "byte":
            suffix = rng.choice([b"\xff", b"}", b"x", b"\x00"])
        elif kind == "huge" and entry is not None:
            entry[rng.choice(("shape", "data_offsets"))] = rng.choice(
                [[0, 2**64], [2**70], [0, 2**63 - 1, 2], Raw("[1e400]"), Raw("[" + "9" * 400 + "]")]
            )
        elif kind == "padding":
            suffix = b" " * rng.randint(1, 9)
        elif kind == "space_before":
            prefix = b" \n"
    if entries and entries[0][0] == "__whole__":
        text = str(entries[0][1]).encode()
    else:
        pairs = Pairs(([("__metadata__", metadata)] if metadata is not None else []) + [tuple(e) for e in entries])
        text = dumps(pairs).encode("utf-8", "surrogatepass")
    header = prefix + text + suffix
    length = len(header)
    if length_change == "zero":
        length = 0
    elif length_change == "max":
        length = 2**64 - 1
    elif length_change == "huge":
        length = 100_000_001
    elif length_change == "file":
        length = len(header) + len(data)
    elif isinstance(length_change, int):
        length = max(0, length + length_change)
    blob = struct.pack("<Q", length) + header + data
    if cut:
        blob = blob[: max(0, len(blob) - cut)]
    expected = {t[0]: (t[1], t[2], t[3]) for t in case["tensors"]}
    return blob, expected


def _offsets(entry: dict) -> list[int] | None:
    offsets = entry.get("data_offsets")
    is_pair = isinstance(offsets, list) and len(offsets) == 2
    return offsets if is_pair and all(type(o) is int and 0 <= o < 2**40 for o in offsets) else None


def _valid_header(case: dict[str, Any]) -> bool:
    names = [t[0] for t in case["tensors"]]
    return (
        all(kind in BENIGN for kind, *_ in case["mutations"])
        and len(set(names)) == len(names)
        and not any(kind == "name_ok" for kind, *_ in case["mutations"])
    )


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def run_header(case: dict[str, Any]) -> tuple[str, str]:
    from safetensors import safe_open

    from tightfit.loading import Checkpoint

    blob, expected = build_header(case)
    valid = _valid_header(case)
    with tempfile.TemporaryDirectory(prefix="case-", dir=_workspace()) as scratch:
        file = Path(scratch) / "model.safetensors"
        file.write_bytes(blob)
        try:
            checkpoint = Checkpoint(scratch)
            read = {name: (entry, _as_bytes(checkpoint.read(name))) for name, entry in checkpoint.entries.items()}
        except CLEAN as error:
            return ("refused" if valid else "clean"), f"{type(error).__name__}: {error}"
        try:  # the reference: what the safetensors library reads
            with safe_open(str(file), "pt") as reference:
                library = {name: _as_bytes(reference.get_tensor(name)) for name in reference.keys()}  # noqa: SIM118
                library_metadata = reference.metadata() or {}
        except Exception as error:  # the library refuses it: tightfit must have too
            return "wrong", f"tightfit read a file the safetensors library refuses ({error})"
    if set(read) != set(library) or any(read[name][1] != library[name] for name in read):
        return "wrong", f"tightfit read {sorted(read)}, the safetensors library {sorted(library)}, or other bytes"
    if checkpoint.metadata != library_metadata:
        return "wrong", f"metadata {checkpoint.metadata} differs from the library's {library_metadata}"
    if valid and {name: data for name, (_, _, data) in expected.items()} != {n: b for n, (_, b) in read.items()}:
        return "wrong", "a valid file read other tensors than written"
    return "equal", f"read {len(read)} tensors as the safetensors library does"


# -- folders through tightfit.load ----------------------------------------------------------------


def _pick(rng: random.Random, pool: tuple | list) -> Any:
    return pool[rng.randrange(len(pool))]


INDEX_FILES = (
    "",
    ".",
    "..",
    "../model-00001-of-00002.safetensors",
    "/etc/passwd",
    "sub/model-00001-of-00002.safetensors",
    "nonexistent.safetensors",
    "config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "a\\b",
    "model-00001-of-00002.safetensors\u0000",
)


def draw_index(rng: random.Random) -> list[tuple]:
    mutations: list[tuple] = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        kind = rng.choice(("weight_map", "entry", "entry", "drop", "add", "metadata", "text", "shard"))
        if kind == "weight_map":
            mutations.append(("weight_map", _pick(rng, _HOSTILE)))
        elif kind == "entry":
            mutations.append(("entry", rng.randrange(1 << 16), _pick(rng, INDEX_FILES + (7, None, ["a"]))))
        elif kind == "drop":
            mutations.append(("drop", rng.randrange(1 << 16)))
        elif kind == "add":
            mutations.append(("add", rng.choice(("extra.weight", "")), _pick(rng, INDEX_FILES)))
        elif kind == "metadata":  # tightfit reads only the weight map
            mutations.append(("metadata", _pick(rng, ({}, None, "x", [1], 5, {"total_size": -1}))))
        elif kind == "text":
            mutations.append(("text", rng.choice(_TEXT_DAMAGE), rng.randrange(1 << 30)))
        else:
            mutations.append(("shard", rng.choice(("directory", "empty", "missing", "garbage"))))
    return mutations


def apply_index(folder: Path, mutations: list[tuple]) -> None:
    file = folder / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    weight_map = index["weight_map"]
    names = sorted(weight_map)
    text_damage = []
    for kind, *args in mutations:
        if kind == "weight_map":
            index["weight_map"] = args[0]
        elif kind == "entry" and isinstance(index["weight_map"], dict):
            index["weight_map"][names[args[0] % len(names)]] = args[1]
        elif kind == "drop" and isinstance(index["weight_map"], dict):
            index["weight_map"].pop(names[args[0] % len(names)], None)
        elif kind == "add" and isinstance(index["weight_map"], dict):
            index["weight_map"][args[0]] = args[1]
        elif kind == "metadata":
            index["metadata"] = args[0]
        elif kind == "text":
            text_damage.append(args)
        elif kind == "shard":
            shard = folder / "model-00002-of-00002.safetensors"
            if shard.is_dir():
                shard.rmdir()
            elif shard.exists():
                shard.unlink()
            if args[0] == "directory":
                shard.mkdir()
            elif args[0] == "empty":
                shard.write_bytes(b"")
            elif args[0] == "garbage":
                shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b"\x00" * 12)
    text = dumps(index).encode("utf-8", "surrogatepass")
    for how, number in text_damage:
        text = _damage_text(text, how, random.Random(number))
    file.write_bytes(text)


def _valid_index(mutations: list[tuple]) -> bool:
    return all(kind == "metadata" for kind, *_ in mutations)


#: The keys of a Llama config and values that break it, or that transformers and tightfit must agree on.
CONFIG_CASES = (
    ("num_attention_heads", 5),
    ("num_attention_heads", 0),
    ("num_key_value_heads", 0),
    ("num_key_value_heads", 3),
    ("hidden_size", "64"),
    ("hidden_size", 60),
    ("hidden_act", "nonesuch"),
    ("hidden_act", 3),
    ("hidden_act", "gelu"),
    ("rope_parameters", {"rope_type": "nonesuch", "rope_theta": 10000.0}),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0}),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "x"}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": -1}),
    ("rope_parameters", [1]),
    ("rope_scaling", {"type": "nonesuch", "factor": 2.0}),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("pad_token_id", 10**6),
    ("pad_token_id", -1),
    ("pad_token_id", -300),
    ("pad_token_id", "0"),
    ("quantization_config", [1]),
    ("quantization_config", None),
    ("quantization_config", "bitsandbytes"),
    ("architectures", "LlamaForCausalLM"),
    ("architectures", 5),
    ("architectures", [5]),
    ("architectures", []),
    ("architectures", ["LlamaModel"]),
    ("architectures", ["NoSuchForCausalLM"]),
    ("architectures", {"a": 1}),
    ("vocab_size", 0),
    ("vocab_size", 300),
    ("intermediate_size", 0),
    ("head_dim", 0),
    ("head_dim", 7),
    ("head_dim", 8),
    ("num_hidden_layers", -1),
    ("num_hidden_layers", 2**64),
    ("num_hidden_layers", 1),
    ("num_hidden_layers", 0),
    ("max_position_embeddings", -3),
    ("max_position_embeddings", 10**30),
    ("_attn_implementation", "nonesuch"),
    ("layer_types", 5),
    ("tie_word_embeddings", "yes"),
    ("tie_word_embeddings", True),
    ("dtype", "int8"),
    ("dtype", "bfloat16"),
    ("dtype", 5),
    ("torch_dtype", "float16"),
    ("model_type", "bert"),
    ("model_type", 5),
    ("rms_norm_eps", -1.0),
    ("attention_dropout", 5.0),
    ("eos_token_id", [1, "x"]),
)


def draw_config(rng: random.Random, keys: list[str]) -> list[tuple]:
    mutations: list[tuple] = []
    for _ in range(rng.choice((0, 1, 1, 1, 2))):
        kind = rng.choice(("case", "case", "set", "set", "drop", "text"))
        if kind == "case":
            mutations.append(("set", *rng.choice(CONFIG_CASES)))
        elif kind == "set":
            mutations.append(("set", rng.choice(keys + ["unknown_key"]), _pick(rng, _HOSTILE)))
        elif kind == "drop":
            mutations.append(("drop", rng.choice(keys)))
        else:
            mutations.append(("text", rng.choice(_TEXT_DAMAGE), rng.randrange(1 << 30)))
    return mutations


def apply_json(file: Path, mutations: list[tuple], edit: Callable[[Any, tuple], Any] | None = None) -> None:
    """Apply ("set", key, value), ("drop", key), ("text", how, seed) and, through ``edit``, other mutations."""
    document = json.loads(file.read_text())
    damage = []
    for mutation in mutations:
        kind, *args = mutation
        if kind == "set" and isinstance(document, dict):
            document[args[0]] = args[1]
        elif kind == "drop" and isinstance(document, dict):
            document.pop(args[0], None)
        elif kind == "text":
            damage.append(args)
        elif edit is not None:
            document = edit(document, mutation)
    text = dumps(document).encode("utf-8", "surrogatepass")
    for how, number in damage:
        text = _damage_text(text, how, random.Random(number))
    file.write_bytes(text)


PLAN_FIELDS = {
    "module": ("model.layers.9", "", "nonesuch", "model.layers.0.mlp", "lm_head", 5, None),
    "kind": ("layer", "leaf", "rest", "x", 1),
    "storage": ("keep", "nf4", "fp4", "8bit", "int8", "float8", "x", None),
    "placement": ("device", "cpu", "disk", "gpu", 1),
    "bytes_before": (-1, 10**30, "1", 1.5, None, True),
    "held_bytes": (-1, 10**30, "1", Raw("NaN")),
    "seconds": (Raw("NaN"), -1, "x", 1e308, Raw("Infinity")),
    "leaves": ([], ["model.layers.9.mlp"], "model.layers.0", [1], None, ["lm_head", "lm_head"]),
    "why": (5, None, ""),
}
PLAN_TOP = {
    "model": ("LlamaModel", "X", 5),
    "device": ("cuda:0", "meta", "cpu:1", "x", 5, ""),
    "backend": ("x", 5, "cuda"),
    "budget_bytes": (-1, "1", 10**30),
    "covers_load": (False, 1, "true"),
    "format": (2, "x", None),
    "runtime": ("compiled", "x"),
    "hints": ({"model.layers.0": {"x": 1}}, {"nonesuch": {}}, []),
    "entries": ([], {}, None, "x"),
    "allow": ({"storage": 5}, [], 5),
    "calibration": ([], {"a": _deep(40)}),
    "int8_outliers": (5, "x"),
    "predicted_peak_bytes": (-5, 2**70),
    "unknown": (1,),
}


def draw_plan(rng: random.Random) -> list[tuple]:
    mutations: list[tuple] = []
    for _ in range(rng.choice((0, 1, 1, 1, 2))):
        kind = rng.choice(("entry", "entry", "entry", "top", "drop", "shuffle", "text"))
        if kind == "entry":
            field = rng.choice(sorted(PLAN_FIELDS))
            mutations.append(("entry", rng.randrange(1 << 16), field, _pick(rng, PLAN_FIELDS[field])))
        elif kind == "top":
            key = rng.choice(sorted(PLAN_TOP))
            mutations.append(("set", key, _pick(rng, PLAN_TOP[key])))
        elif kind == "drop":
            mutations.append(("drop", rng.choice(sorted(PLAN_TOP))))
        elif kind == "shuffle":
            mutations.append(("entries", rng.choice(("reverse", "duplicate", "drop_one")), rng.randrange(1 << 16)))
        else:
            mutations.append(("text", rng.choice(_TEXT_DAMAGE), rng.randrange(1 << 30)))
    return mutations


def _edit_plan(plan: Any, mutation: tuple) -> Any:
    kind, *args = mutation
    entries = plan.get("entries") if isinstance(plan, dict) else None
    if not isinstance(entries, list) or not entries:
        return plan
    if kind == "entry":
        entry = entries[args[0] % len(entries)]
        if isinstance(entry, dict):
            entry[args[1]] = args[2]
    elif kind == "entries":
        how, number = args
        if how == "reverse":
            entries.reverse()
        elif how == "duplicate":
            entries.append(copy.deepcopy(entries[number % len(entries)]))
        else:
            del entries[number % len(entries)]
    return plan


BNB_VALUES = {
    "quant_method": ("gptq", "", None, 5, "BitsAndBytes"),
    "load_in_4bit": (False, "true", 1, None),
    "load_in_8bit": (True, "false", 0),
    "bnb_4bit_quant_type": ("fp4", "int4", "", 4, None, ["nf4"]),
    "bnb_4bit_use_double_quant": (True, "false", 1, None),
    "bnb_4bit_compute_dtype": ("int8", "float64", 5, "torch.float32", ["float32"]),
    "bnb_4bit_quant_storage": ("bfloat16", "float64", "int4", 5, None),
    "llm_int8_threshold": (-1.0, Raw("NaN"), "6", None, True, Raw("1e400")),
    "llm_int8_skip_modules": (5, "lm_head", [5], {"a": 1}),
    "unknown_key": (1, "x"),
}


def draw_bitsandbytes(rng: random.Random) -> list[tuple]:
    mutations: list[tuple] = []
    for _ in range(rng.choice((0, 1, 1, 1, 2))):
        kind = rng.choice(("field", "field", "field", "drop", "whole", "text"))
        if kind == "field":
            key = rng.choice(sorted(BNB_VALUES))
            mutations.append(("field", key, _pick(rng, BNB_VALUES[key])))
        elif kind == "drop":
            mutations.append(("drop_field", rng.choice(sorted(BNB_CONFIG))))
        elif kind == "whole":
            mutations.append(("set", "quantization_config", _pick(rng, _HOSTILE)))
        else:
            mutations.append(("text", rng.choice(_TEXT_DAMAGE), rng.randrange(1 << 30)))
    return mutations


def _edit_bitsandbytes(config: Any, mutation: tuple) -> Any:
    kind, *args = mutation
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quantization, dict):
        return config
    if kind == "field":
        quantization[args[0]] = args[1]
    elif kind == "drop_field":
        quantization.pop(args[0], None)
    return config


#: Changes that leave a bitsandbytes config meaning what it meant: an unknown key, and
#: values at their defaults written out or left out (transformers' defaults are tightfit's).
_BNB_NEUTRAL = {("field", "unknown_key"), ("drop_field", "load_in_8bit"), ("drop_field", "llm_int8_threshold")}
_BNB_NEUTRAL |= {("drop_field", key) for key in BNB_CONFIG if key.startswith("llm_int8_")}


def _valid_bitsandbytes(mutations: list[tuple]) -> bool:
    return all((kind, args[0]) in _BNB_NEUTRAL for kind, *args in mutations)


def _causal_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _config_reference(folder: Path, model: Any) -> tuple[str, str]:
    """A config tightfit loaded, against what transformers builds from it: the LM head
    where ``architectures`` names a causal LM, and the same outputs."""
    import transformers

    raw = json.loads((folder / "config.json").read_text())
    named = raw.get("architectures")
    named = [named] if isinstance(named, str) else named
    if isinstance(named, list) and set(named) & _causal_names() and type(model).__name__ not in _causal_names():
        return "wrong", f"config.json names {named}, but tightfit built a {type(model).__name__} (no LM head)"
    auto = transformers.AutoModelForCausalLM if type(model).__name__ in _causal_names() else transformers.AutoModel
    dtype = next(model.parameters()).dtype
    try:
        reference = auto.from_pretrained(folder, dtype=dtype).eval()
    except Exception as error:
        return "wrong", f"tightfit loaded a config that transformers refuses: {type(error).__name__}: {error}"
    expected = _outputs(reference)
    return ("equal", "loaded as transformers does") if _same(_outputs(model), expected) else ("wrong", "outputs differ")


def run_folder(target: str, mutations: list[tuple]) -> tuple[str, str]:
    """A mutated copy of the target's folder through :func:`tightfit.load`; the outcome."""
    import tightfit

    if target == "index":
        source, (_, expected), valid = sharded(), base(), _valid_index(mutations)
    elif target == "config":
        (source, expected), valid = base(), not mutations
    elif target == "plan":
        (source, expected), valid = saved(), not mutations
    else:
        (source, expected), valid = prequantized(), _valid_bitsandbytes(mutations)
    with _copy(source) as folder:
        if target == "index":
            apply_index(folder, mutations)
        elif target == "config":
            apply_json(folder / "config.json", mutations)
        elif target == "plan":
            apply_json(folder / "tightfit-plan.json", mutations, _edit_plan)
        else:
            apply_json(folder / "config.json", mutations, _edit_bitsandbytes)
        arguments = {} if target == "plan" else {"example_inputs": {"input_ids": IDS}, "calibration": calibration()}
        try:
            model, _ = tightfit.load(folder, None if target == "plan" else BUDGET, **arguments)
            got = _outputs(model)
        except CLEAN as error:
            return ("refused" if valid else "clean"), f"{type(error).__name__}: {error}"
        if target == "config":
            return _config_reference(folder, model)
    return ("equal", "loaded as the reference") if _same(got, expected) else ("wrong", "loaded, outputs differ")


# -- the campaign ---------------------------------------------------------------------------------


@dataclass
class LoaderCase:
    """One generated case: ``call`` is (target, the case's mutations or header)."""

    op: str
    label: str
    call: tuple


_CONFIG_KEYS = (
    "architectures",
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "dtype",
    "eos_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "max_position_embeddings",
    "mlp_bias",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pad_token_id",
    "pretraining_tp",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "use_cache",
    "vocab_size",
)


def make_case(seed: int, index: int) -> LoaderCase:
    """Case ``index`` of campaign ``seed``: the targets take turns."""
    rng = random.Random(f"loading:{seed}:{index}")
    target = TARGETS[index % len(TARGETS)]
    if target == "header":
        detail: Any = draw_header(rng)
        label = f"{len(detail['tensors'])} tensors, mutations {[m[0] for m in detail['mutations']]}"
    else:
        draw = {
            "index": draw_index,
            "config": lambda r: draw_config(r, list(_CONFIG_KEYS)),
            "plan": draw_plan,
            "bitsandbytes": draw_bitsandbytes,
        }[target]
        detail = draw(rng)
        label = ", ".join(f"{m!r:.80}" for m in detail) or "unchanged"
    return LoaderCase(target, label, (target, detail))


def run_case(case: LoaderCase, index: int) -> tuple[str, str]:
    """The campaign's outcome of one case (see the module's docstring)."""
    target, detail = case.call
    try:
        return run_header(detail) if target == "header" else run_folder(target, detail)
    except Exception:  # anything else is the failure under test: report it instead of raising in the worker
        return "unclean", traceback.format_exc(limit=-6)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], target="tightfit.loading.fuzz"))
