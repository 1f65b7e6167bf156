"""Files read from outside (D9): JSON read with a size cap and every way it can be bad
turned into a ValueError naming the file, and the identity stamp of a file that is
re-checked before it is read again. Private.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__: list[str] = []  # private helpers

#: The most bytes of JSON read from one file (config.json, a shard index, a saved plan,
#: a cache): far above what any of them holds, far below what could exhaust memory.
MAX_JSON_BYTES = 100_000_000


def cache_dir() -> Path:
    """Where tightfit keeps what it measures or builds once per machine (calibration
    figures, compiled kernels): ``$TIGHTFIT_CACHE_DIR``, default ``~/.cache/tightfit``."""
    return Path(os.environ.get("TIGHTFIT_CACHE_DIR") or Path.home() / ".cache" / "tightfit")


def file_stamp(stat: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells one version of a file from another without reading it: (device, inode,
    size, modification time, status-change time). Replacing the file (a rename, ``rsync``,
    ``tar x``) changes the inode; writing to it in place changes the status-change time
    even where the modification time is set back (``cp -p``, ``touch -d``), which only the
    kernel can set. Every re-check of a file compares these."""
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _refuse_duplicates(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{where} names {key!r:.200} twice; accepted: each key once")
            out[key] = value
        return out

    return hook


def _refuse_constant(where: str):
    def hook(name: str) -> Any:
        raise ValueError(f"{where} holds {name}, which is not JSON; accepted: numbers, strings, true, false, null")

    return hook


def parse_json(data: bytes | str, where: str, *, strict: bool = False, what: str = "is not valid JSON") -> Any:
    """The JSON value in ``data`` (bytes must be UTF-8, with no byte-order mark); a
    ValueError "``where`` ``what``: why" when it is not JSON, not UTF-8, nested too deeply
    or holds an integer too long to convert. ``strict``: also refuse an object naming a key
    twice (Python would keep the last silently) and NaN or Infinity (Python's extension)."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        if not isinstance(text, str):
            raise TypeError(f"{where} must be bytes or str, got {type(data).__name__}")
        if strict:
            return json.loads(text, object_pairs_hook=_refuse_duplicates(where), parse_constant=_refuse_constant(where))
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where} {what}: nested too deeply (maximum recursion depth exceeded)") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits, a duplicate
        if str(error).startswith(where):
            raise ValueError(str(error)) from None
        raise ValueError(f"{where} {what}: {str(error):.300}") from None


def _read_capped(file: str | Path, limit: int) -> bytes:
    with open(file, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{file} is larger than {limit} bytes; accepted: at most {limit} bytes")
    return data


def read_text(file: str | Path, limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of ``file``, at most ``limit`` bytes; a ValueError naming the file
    where it is longer or not UTF-8 (OSError where it cannot be read)."""
    try:
        return _read_capped(file, limit).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{file} is not valid UTF-8 text: {error}") from None


def read_json(file: str | Path, *, limit: int = MAX_JSON_BYTES, strict: bool = False) -> Any:
    """The JSON value in ``file`` (UTF-8, at most ``limit`` bytes): a ValueError naming the
    file where it is not (see :func:`parse_json`), OSError where it cannot be read."""
    return parse_json(_read_capped(file, limit), str(file), strict=strict)
