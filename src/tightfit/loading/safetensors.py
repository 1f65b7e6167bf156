"""A checkpoint of safetensors shards, read tensor by tensor (D9: everything read from
disk is checked).

Each shard's header is parsed and checked when the checkpoint is opened, refusing what
the safetensors format refuses (as its own library does), naming the file and the entry:
an 8-byte little-endian length of at most 100,000,000 bytes that the file holds; a UTF-8
JSON object (no byte-order mark, no name given twice) whose ``__metadata__``, when there,
maps strings to strings; every other entry a tensor with exactly a known dtype, a shape of
sizes >= 0 and ``data_offsets`` [begin, end] of exactly the shape's byte count, the
tensors together covering the data after the header exactly: the first at 0, each where
the one before ends, no gap, no overlap and nothing after the last.

A tensor is read with ordinary reads into a fresh tensor (so its bytes are the allocator's
and a file cut short is an error, never a SIGBUS), from the shard opened and found the same
file as when its header was read (:func:`tightfit._files.file_stamp`: device, inode,
size, modification and status-change times), and checked again after the read. Where the
shard had changed within a few seconds of its header being read, so that a rewrite in the
same tick of the file system's clock could keep its stamp, the header's bytes are compared
too before each read. Private to ``tightfit.loading``.
"""

from __future__ import annotations

import math
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from tightfit._files import file_stamp, parse_json, read_json
from tightfit._validate import check_type
from tightfit.hooks._disk import read_bytes

__all__ = ["Checkpoint", "TensorEntry"]

#: safetensors dtype names and the torch dtypes they hold.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library sets itself
#: The most elements (and bytes) a tensor may have: torch counts them in int64.
_MAX_ELEMENTS = 2**63 - 1
#: A shard whose status-change time is this recent when its header is read may be
#: rewritten within the same tick of the file system's clock, unseen by its stamp.
_RACY_NS = 3_000_000_000
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


def _utf8(where: str, text: str) -> None:
    """Refuse a string that JSON escapes made of lone surrogates: it is not UTF-8 (the safetensors library refuses it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} {text!r:.200} is not valid UTF-8 (a lone surrogate escape)") from None


def _metadata(file: Path, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(
            f"{file}: __metadata__ must be an object of strings, got {type(value).__name__} {value!r:.200}; "
            f"accepted: a JSON object mapping strings to strings, or no __metadata__"
        )
    for key, text in value.items():
        _utf8(f"{file}: __metadata__ key", key)
        _utf8(f"{file}: __metadata__[{key!r}]", text)
    return value


def _entry(file: Path, name: str, info: object, data_start: int) -> TensorEntry:
    """One tensor's checked entry: dtype, shape, and a byte range of exactly its size."""
    where = f"{file}: tensor {name!r}"
    _utf8(f"{file}: tensor name", name)
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{where} must be an object with dtype, shape and data_offsets, got {info!r:.200}")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"{where} has dtype {info['dtype']!r:.40}; accepted: {', '.join(DTYPES)}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{where} has shape {shape!r:.200}; accepted: a list of ints >= 0")
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize > _MAX_ELEMENTS:
        raise ValueError(f"{where} has shape {shape!r:.200}; accepted: at most {_MAX_ELEMENTS} bytes in all")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise ValueError(f"{where} has data_offsets {offsets!r:.200}; accepted: [begin, end], two ints")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end or end - begin != nbytes:
        raise ValueError(
            f"{where} has data_offsets [{begin}, {end}]; accepted: [begin, begin + {nbytes}], the {nbytes} bytes "
            f"of shape {shape} in {info['dtype']}, begin >= 0"
        )
    return TensorEntry(file, dtype, tuple(shape), data_start + begin, nbytes)


def _check_layout(file: Path, entries: dict[str, TensorEntry], data_start: int, data_size: int) -> None:
    """The tensors cover the data exactly, in order of their offsets: the first at 0, each
    where the one before ends, the last at the file's end."""
    position, before = 0, None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].nbytes)):
        begin = entry.start - data_start
        if begin != position:
            if before is None:
                problem = f"tensor {name!r} is the first in the data but begins at byte {begin}, not 0"
            elif begin < position:
                problem = f"tensors {before!r} and {name!r} overlap in the file"
            else:
                problem = f"there are {begin - position} bytes between tensors {before!r} and {name!r}"
            raise ValueError(
                f"{file}: {problem}; accepted: tensors laid end to end from byte 0 of the data, as the "
                f"safetensors format requires"
            )
        position, before = begin + entry.nbytes, name
        if position > data_size:
            raise ValueError(
                f"{file}: tensor {name!r} has data_offsets [{begin}, {position}], past the end of the file's "
                f"{data_size} bytes of data; accepted: a range inside the data"
            )
    if position != data_size:
        last = f"after tensor {before!r}" if before is not None else "and no tensor"
        raise ValueError(
            f"{file}: its data holds {data_size - position} bytes {last}, which no entry covers; accepted: the "
            f"tensors cover the data exactly, as the safetensors format requires"
        )


def _read_header(handle: BinaryIO, file: Path, size: int) -> tuple[bytes, dict[str, TensorEntry], dict[str, str]]:
    """The raw header of one open shard, its checked entries and its ``__metadata__``."""
    handle.seek(0)
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
    if len(raw) != length:
        raise ValueError(f"{file} ends inside its safetensors header")
    header = parse_json(raw, f"{file}: its safetensors header", strict=True)
    if not isinstance(header, dict):
        raise ValueError(f"{file}: its safetensors header must be a JSON object, got {type(header).__name__}")
    metadata = _metadata(file, header.pop("__metadata__", None))
    data_start, data_size = 8 + length, size - 8 - length
    entries = {name: _entry(file, name, info, data_start) for name, info in header.items()}
    _check_layout(file, entries, data_start, data_size)
    return head + raw, entries, metadata


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
        self._stamps: dict[Path, tuple[int, ...]] = {}
        self._racy: dict[Path, bytes] = {}  # the raw header of each shard changed just before it was read
        for shard in shards:
            if not shard.is_file():
                raise ValueError(f"{shard} is missing; the checkpoint's index names it")
            with open(shard, "rb") as handle:
                stat = os.fstat(handle.fileno())
                raw, entries, metadata = _read_header(handle, shard, stat.st_size)
            if stat.st_ctime_ns > time.time_ns() - _RACY_NS:
                self._racy[shard] = raw
            self._stamps[shard] = file_stamp(stat)
            for name in entries.keys() & self.entries.keys():
                raise ValueError(f"tensor {name!r} is in two shards: {self.entries[name].file.name} and {shard.name}")
            self.entries.update(entries)
            self.metadata.update(metadata)

    @staticmethod
    def _shards(folder: Path, index: Path) -> list[Path]:
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and not {"/", "\\", "\0"} & set(name) and name not in ("", ".", "..")
            for name in weight_map.values()
        ):
            raise ValueError(
                f"{index} must hold a JSON object whose 'weight_map' maps tensor names to shard file names "
                f"(in the same folder); got weight_map={weight_map!r:.200}"
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

    def source(self, names: list[str], prefix: str) -> str | None:
        """:meth:`find` for a tensor the model ties under several ``names`` (an embedding
        and the LM head, ``tie_word_embeddings``): where the checkpoint holds more than one
        of them, they must hold the same values, else a ValueError (transformers then
        leaves them untied; tying would compute with one in place of the other)."""
        found = self.find(names, prefix)
        for name in names[1:] if found is not None else ():
            other = self.find([name], prefix)
            if other is not None and other != found and not self.same_values(found, other):
                raise ValueError(
                    f"{self.folder / 'config.json'} ties {', '.join(names)} (tie_word_embeddings), but the checkpoint "
                    f"holds {found!r} and {other!r} with different values; accepted: tie_word_embeddings false (the "
                    f"checkpoint's two tensors are kept, as transformers keeps them), or one tensor for both"
                )
        return found

    def same_values(self, first: str, second: str, chunk: int = 1 << 16) -> bool:
        """Whether two tensors have the same dtype, shape and bytes (compared a small chunk
        at a time, outside torch's allocator: nothing the plan's load peak would count)."""
        a, b = self._entry(first), self._entry(second)
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        with open(a.file, "rb") as left, open(b.file, "rb") as right:
            for handle, entry in ((left, a), (right, b)):
                self._unchanged(entry.file, handle)
                handle.seek(entry.start)
            for begin in range(0, a.nbytes, chunk):
                size = min(chunk, a.nbytes - begin)
                one, other = left.read(size), right.read(size)
                if len(one) != size or len(other) != size:
                    raise ValueError(f"{a.file} or {b.file} ends short of tensor {first!r} or {second!r}")
                if one != other:
                    return False
            for handle, entry in ((left, a), (right, b)):
                self._unchanged(entry.file, handle)
        return True

    def stamp(self, file: Path) -> tuple[int, ...]:
        """The stamp (:func:`tightfit._files.file_stamp`) shard ``file`` had when its header was read."""
        return self._stamps[file]

    def _unchanged(self, file: Path, handle: BinaryIO | None = None) -> None:
        """Raise ValueError unless ``file`` (or the open ``handle`` of it) is the file whose header was read."""
        try:
            stat = os.fstat(handle.fileno()) if handle is not None else file.stat()
        except FileNotFoundError:
            stat = None
        same = stat is not None and file_stamp(stat) == self._stamps[file]
        if same and file in self._racy:
            raw = self._racy[file]
            if handle is None:
                with open(file, "rb") as reread:
                    same = reread.read(len(raw)) == raw
            else:
                handle.seek(0)
                same = handle.read(len(raw)) == raw
        if not same:
            raise ValueError(
                f"{file} changed on disk after its header was checked (replaced, removed, resized or written to); "
                f"nothing more is read from it: load the model again"
            )

    def _entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise KeyError(f"the checkpoint in {self.folder} has no tensor {name!r}")
        return entry

    def check(self, name: str) -> TensorEntry:
        """The entry of tensor ``name``, once its shard is known unchanged since its header was checked."""
        entry = self._entry(name)
        self._unchanged(entry.file)
        return entry

    def read(self, name: str) -> torch.Tensor:
        """A fresh CPU tensor holding the tensor ``name``, read with ordinary reads from its
        shard, opened and found unchanged since its header was checked, before the read and after."""
        entry = self._entry(name)
        with open(entry.file, "rb", buffering=0) as handle:
            self._unchanged(entry.file, handle)
            out = read_bytes(
                handle,
                entry.start,
                entry.nbytes,
                lambda missing: ValueError(f"{entry.file} ends {missing} bytes short of tensor {name!r}"),
            )
            self._unchanged(entry.file, handle)
        if entry.dtype == torch.bool and entry.nbytes and int(out.max()) > 1:
            raise ValueError(
                f"{entry.file}: tensor {name!r} is BOOL but holds a byte of value {int(out.max())}; accepted: 0 and 1"
            )
        return out.view(entry.dtype).reshape(entry.shape)
