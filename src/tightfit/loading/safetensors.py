"""A checkpoint of safetensors shards, read tensor by tensor (D9: everything read from
disk is checked).

Each shard's header is parsed and checked when the checkpoint is opened: a JSON object of
at most 100 MiB whose entries name a known dtype, a shape of sizes >= 0 and a byte range
that lies inside the file's data, is exactly the shape's size and overlaps no other.
A tensor is read with ordinary reads into a fresh tensor (so its bytes are the allocator's
and a file cut short is an error, never a SIGBUS), after checking that the shard has not
been resized or rewritten since it was opened. Private to ``tightfit.loading``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tightfit._validate import check_type
from tightfit.hooks._disk import read_bytes
from tightfit.loading.folder import read_json

__all__ = ["Checkpoint", "TensorEntry"]

#: safetensors dtype names and the torch dtypes they hold.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors library sets itself
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its shard, dtype, shape and byte range in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


def _header(file: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The checked entries of one shard, and its ``__metadata__``."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError(f"{file} is not a safetensors file: {size} bytes, shorter than its header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(
                f"{file} is not a safetensors file: its header claims {length} bytes; the file has {size - 8} after "
                f"the length, and headers above {_MAX_HEADER_BYTES} bytes are refused"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{file}: its safetensors header is not UTF-8 JSON: {str(error):.200}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: its safetensors header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{file}: __metadata__ must be an object of strings")
    data_start, data_size = 8 + length, size - 8 - length
    entries, ranges = {}, []
    for name, info in header.items():
        where = f"{file}: tensor {name!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{where} must be an object with dtype, shape and data_offsets, got {info!r:.200}")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{where} has dtype {info['dtype']!r:.40}; accepted: {', '.join(DTYPES)}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{where} has shape {shape!r:.200}; accepted: a list of ints >= 0")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
            raise ValueError(f"{where} has data_offsets {offsets!r:.200}; accepted: [begin, end], two ints")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_size or end - begin != nbytes:
            raise ValueError(
                f"{where} has data_offsets [{begin}, {end}]; accepted: a range of {nbytes} bytes (shape {shape}, "
                f"{info['dtype']}) inside the file's {data_size} bytes of data"
            )
        entries[name] = TensorEntry(file, dtype, tuple(shape), data_start + begin, nbytes)
        ranges.append((begin, end, name))
    ranges.sort()
    for (_, end, first), (begin, _, second) in zip(ranges, ranges[1:]):
        if begin < end:
            raise ValueError(f"{file}: tensors {first!r} and {second!r} overlap in the file")
    return entries, metadata


class Checkpoint:
    """The safetensors checkpoint of a folder: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names. ``entries``: every tensor by name."""

    def __init__(self, folder: str | Path) -> None:
        check_type("folder", folder, (str, Path))
        folder = Path(folder)
        index = folder / INDEX_FILE
        if (folder / SINGLE_FILE).is_file():
            shards = [folder / SINGLE_FILE]
        elif index.is_file():
            shards = self._shards(folder, index)
        else:
            found = sorted(p.name for p in folder.glob("*.bin"))
            more = f"; it has pickled weights ({', '.join(found)}): convert them to safetensors" if found else ""
            raise ValueError(
                f"model={str(folder)!r} has no safetensors checkpoint ({SINGLE_FILE} or {INDEX_FILE}){more}"
            )
        self.folder = folder
        self.entries: dict[str, TensorEntry] = {}
        self.metadata: dict[str, str] = {}
        self._stamps: dict[Path, tuple[int, int]] = {}
        for shard in shards:
            if not shard.is_file():
                raise ValueError(f"{shard} is missing; the checkpoint's index names it")
            stat = shard.stat()
            self._stamps[shard] = (stat.st_size, stat.st_mtime_ns)
            entries, metadata = _header(shard)
            for name in entries.keys() & self.entries.keys():
                raise ValueError(f"tensor {name!r} is in two shards: {self.entries[name].file.name} and {shard.name}")
            self.entries.update(entries)
            self.metadata.update(metadata)

    @staticmethod
    def _shards(folder: Path, index: Path) -> list[Path]:
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and "/" not in name and name not in ("", ".", "..") for name in weight_map.values()
        ):
            raise ValueError(
                f"{index} must hold a JSON object whose 'weight_map' maps tensor names to shard file names"
            )
        return [folder / name for name in sorted(set(weight_map.values()))]

    def find(self, names: list[str], prefix: str) -> str | None:
        """The name this checkpoint holds a tensor under, the tensor known by ``names``: as
        is, or with the base model's ``prefix`` added or dropped (a base model's checkpoint
        in a model with a head, and the other way round); None where it holds none."""
        for name in names:
            candidates = [name, f"{prefix}.{name}"] if prefix else [name]
            if prefix and name.startswith(f"{prefix}."):
                candidates.append(name[len(prefix) + 1 :])
            found = next((c for c in candidates if c in self.entries), None)
            if found is not None:
                return found
        return None

    def check(self, name: str) -> TensorEntry:
        """The entry of tensor ``name``, once its shard is known unchanged since its header was checked."""
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(f"the checkpoint in {self.folder} has no tensor {name!r}")
        stat = entry.file.stat()
        if (stat.st_size, stat.st_mtime_ns) != self._stamps[entry.file]:
            raise ValueError(
                f"{entry.file} changed on disk after its header was checked (size or modification time); "
                f"nothing more is read from it: load the model again"
            )
        return entry

    def read(self, name: str) -> torch.Tensor:
        """A fresh CPU tensor holding the tensor ``name``, read with ordinary reads."""
        entry = self.check(name)
        with open(entry.file, "rb", buffering=0) as handle:
            out = read_bytes(
                handle,
                entry.start,
                entry.nbytes,
                lambda missing: ValueError(f"{entry.file} ends {missing} bytes short of tensor {name!r}"),
            )
        return out.view(entry.dtype).reshape(entry.shape)
