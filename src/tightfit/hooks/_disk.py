"""Tensors kept in an unnamed file on disk and read back through a memory map, without a copy. Private.

The file is created without a name (``O_TMPFILE``, or unlinked at once where the file
system lacks it), so no other process can find it by name to overwrite or truncate it,
and the OS frees its space when the process ends, however it ends. The tensors are
views of a copy-on-write map: the OS reads them in on first touch and may drop them
again under memory pressure.

Data read from outside is checked (D9): the file's modification time is set to a
sentinel after writing, so any later write or truncation shows in one ``fstat``
(:meth:`MappedFile.check`, before every touch of the map); a CRC-32 per tensor, taken
when writing, is verified wherever the bytes are copied out for good
(:meth:`MappedFile.read`, with ordinary reads, so a short file is an error, not a SIGBUS).
"""

from __future__ import annotations

import abc
import mmap
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tightfit._files import file_stamp

__all__: list[str] = []

#: dtypes a disk store holds.
DISK_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)

#: Byte alignment of each tensor in the file (a view of any dtype needs its element size).
_ALIGN = 64


def read_bytes(file: Any, offset: int, nbytes: int, short: Callable[[int], Exception]) -> torch.Tensor:
    """``nbytes`` bytes of the open binary ``file`` from ``offset``, into a fresh uint8 CPU
    tensor, with ordinary reads: a file that ends early raises ``short(missing bytes)``
    (where a memory map would fault)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    buffer = memoryview(out.numpy())
    file.seek(offset)
    done = 0
    while done < nbytes:
        count = file.readinto(buffer[done:])
        if not count:
            raise short(nbytes - done)
        done += count
    return out


class OffloadFileError(RuntimeError):
    """An offload file changed after tightfit wrote it: the weights it holds can no longer be trusted."""


class _Mapped(abc.ABC):
    """What both kinds of mapped file share: the stamp check, ordinary reads, read-ahead,
    closing. A subclass opens ``_file``, maps ``_map`` (from byte ``_base`` of the file),
    takes ``_stamp`` (:func:`~tightfit._files.file_stamp`), fills ``_regions`` (key -> offset, bytes,
    dtype, shape) and says in ``_error`` what the file is."""

    _file: Any
    _map: mmap.mmap
    _base: int = 0
    _stamp: tuple[int, int, int, int, int]
    _regions: dict[str, tuple[int, int, torch.dtype, torch.Size | tuple[int, ...]]]

    @abc.abstractmethod
    def _error(self, what: str) -> OffloadFileError:
        """The error to raise: what happened to the file (``what``), and whose file it is."""

    def _view(self, key: str) -> torch.Tensor:
        offset, nbytes, dtype, shape = self._regions[key]
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset - self._base)
        return raw.view(dtype).reshape(shape)

    def check(self) -> None:
        """Raise :class:`OffloadFileError` when the file was written to or resized since it was stamped."""
        now = file_stamp(os.fstat(self._file.fileno()))
        if now[2] != self._stamp[2]:
            raise self._error(f"was resized from {self._stamp[2]} to {now[2]} bytes")
        if now != self._stamp:
            raise self._error("was written to")

    def _read_bytes(self, key: str) -> torch.Tensor:
        """The tensor's bytes, a fresh CPU copy read with ordinary file reads (a short file is an error)."""
        self.check()
        offset, nbytes, _, _ = self._regions[key]
        return read_bytes(
            self._file, offset, nbytes, lambda missing: self._error(f"ends {missing} bytes short of tensor {key!r}")
        )

    def read(self, key: str) -> torch.Tensor:
        """A fresh CPU copy of one tensor, read with ordinary file reads."""
        _, _, dtype, shape = self._regions[key]
        return self._read_bytes(key).view(dtype).reshape(shape)

    def will_need(self) -> None:
        """Ask the OS to start reading the pages in now (a hint; returns at once)."""
        if hasattr(mmap, "MADV_WILLNEED") and not self._map.closed:
            self._map.madvise(mmap.MADV_WILLNEED)

    def close(self) -> None:
        """Drop the views, unmap and close; the OS frees the pages once no view holds the map."""
        self.tensors = {}
        self._file.close()
        try:
            self._map.close()
        except BufferError:  # a tensor still exported from the map: it is unmapped when that tensor dies
            pass


class MappedFile(_Mapped):
    """One unit's tensors in an unnamed file, memory-mapped; ``tensors`` are views of the map."""

    def __init__(self, folder: Path, unit: str, tensors: dict[str, torch.Tensor]) -> None:
        self.folder = folder
        self.unit = unit
        self._file = tempfile.TemporaryFile(prefix="tightfit-offload-", dir=folder)
        try:
            self._regions, self._crcs = self._write(tensors)
            self._file.flush()
            target = self._file.fileno() if os.utime in os.supports_fd else self._file.name  # Windows: by name
            os.utime(target, ns=(time.time_ns(), 0))  # mtime 0: any later write sets it to the present
            written = os.fstat(self._file.fileno())
            self._stamp = file_stamp(written)
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        except BaseException:
            self._file.close()
            raise
        self.tensors = {key: self._view(key) for key in self._regions}

    def _write(self, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, int]]:
        """Write each tensor's bytes; returns key -> (offset, bytes, dtype, shape), and key -> CRC-32."""
        regions, crcs, offset = {}, {}, 0
        for key, tensor in tensors.items():
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            padding = -offset % _ALIGN
            self._file.write(bytes(padding))
            offset += padding
            self._file.write(data)
            regions[key] = (offset, data.nbytes, tensor.dtype, tensor.shape)
            crcs[key] = zlib.crc32(data)
            offset += data.nbytes
        return regions, crcs

    def _error(self, what: str) -> OffloadFileError:
        return OffloadFileError(
            f"the offload file of unit {self.unit!r} (unnamed, in {self.folder}) {what} after tightfit wrote it: "
            f"the weights it holds can no longer be trusted, and nothing is read from it. Another process wrote to it "
            f"(through /proc/{os.getpid()}/fd) or the disk failed; load the model's weights again"
        )

    def read(self, key: str) -> torch.Tensor:
        """A fresh CPU copy of one tensor, read with ordinary file reads and checked against its CRC-32."""
        raw = self._read_bytes(key)
        if zlib.crc32(memoryview(raw.numpy())) != self._crcs[key]:
            raise self._error(f"holds other bytes than written for tensor {key!r} (CRC-32 mismatch)")
        _, _, dtype, shape = self._regions[key]
        return raw.view(dtype).reshape(shape)


class MappedRegions(_Mapped):
    """Byte ranges of an existing file (a checkpoint's tensors), memory-mapped in place:
    a unit computes straight from the file's pages, with no copy in memory and none on
    disk. The same checks as :class:`MappedFile`, except that there is no CRC to verify
    (the file is not tightfit's): its stamp is taken when it is opened, and a change shows
    in one ``fstat`` before every touch (:meth:`check`).

    ``regions``: key -> (offset, bytes, dtype, shape). ``expected``: the stamp the file had
    when the regions were read from it (a checkpoint's header); the file opened must still
    have it, or :class:`OffloadFileError` is raised. The map is copy-on-write, so a change
    made in place to a tensor never reaches the file.
    """

    def __init__(
        self,
        path: Path,
        unit: str,
        regions: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]],
        expected: tuple[int, ...] | None = None,
    ) -> None:
        self.folder = path.parent
        self.unit = unit
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 (held open for the map's life; closed by close())
        try:
            stat = os.fstat(self._file.fileno())
            self._stamp = file_stamp(stat)
            if expected is not None and self._stamp != expected:
                raise self._error("had been replaced or written to since its header was read")
            for key, (offset, nbytes, _, _) in regions.items():
                if offset < 0 or offset + nbytes > stat.st_size:
                    raise ValueError(f"{path}: tensor {key!r} at bytes {offset}..{offset + nbytes} lies past its end")
            start = min((offset for offset, *_ in regions.values()), default=0)
            self._base = start - start % mmap.ALLOCATIONGRANULARITY
            end = max((offset + nbytes for offset, nbytes, *_ in regions.values()), default=start)
            self._map = mmap.mmap(
                self._file.fileno(), max(end - self._base, 1), access=mmap.ACCESS_COPY, offset=self._base
            )
        except BaseException:
            self._file.close()
            raise
        self._regions = regions
        self.tensors = {key: self._view(key) for key in regions}

    def _error(self, what: str) -> OffloadFileError:
        return OffloadFileError(
            f"{self.path}, which unit {self.unit!r} computes from in place, {what} after tightfit opened it: "
            f"the weights it holds can no longer be trusted, and nothing is read from it; load the model again"
        )
