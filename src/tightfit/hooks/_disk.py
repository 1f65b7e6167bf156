"""Tensors kept in a safetensors file and read back through a memory map, without a copy. Private.

The file is written with the ``safetensors`` package and mapped copy-on-write: the
tensors are views of the page cache, so the OS reads them in on first touch and may
drop them again under memory pressure.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch

from tightfit.models import _require

__all__: list[str] = []

#: safetensors' dtype names (the ones torch has).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

#: dtypes a disk store holds.
DISK_DTYPES: frozenset[torch.dtype] = frozenset(_DTYPES.values())


class MappedFile:
    """A safetensors file of named tensors, memory-mapped; ``tensors`` are views of the map."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        _require("safetensors")
        from safetensors.torch import save_file

        self.path = path
        save_file({key: tensor.detach().to("cpu").contiguous() for key, tensor in tensors.items()}, str(path))
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tensors = self._read_tensors()

    def _read_tensors(self) -> dict[str, torch.Tensor]:
        header_size = int.from_bytes(self._map[:8], "little")
        header = json.loads(self._map[8:8 + header_size])
        base = 8 + header_size
        tensors = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype, (start, end) = _DTYPES[info["dtype"]], info["data_offsets"]
            if end > start:
                raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - start, offset=base + start)
            else:
                raw = torch.empty(0, dtype=torch.uint8)
            tensors[key] = raw.view(dtype).reshape(info["shape"])
        return tensors

    def will_need(self) -> None:
        """Ask the OS to start reading the file's pages in now (a hint; returns at once)."""
        if hasattr(mmap, "MADV_WILLNEED") and not self._map.closed:
            self._map.madvise(mmap.MADV_WILLNEED)

    def close(self) -> None:
        """Drop the views and unmap; a view still held elsewhere keeps the map alive until it goes."""
        self.tensors = {}
        try:
            self._map.close()
        except BufferError:  # a tensor still exported from the map: it is unmapped when that tensor dies
            pass
