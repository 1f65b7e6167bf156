"""Memory sizes written the way people write them: ``40MB``, ``1.5GiB``, ``123456``."""

from __future__ import annotations

import math
import re

__all__ = ["UNITS", "parse_size"]

#: Accepted suffixes (case-insensitive) and their bytes: decimal (KB = 1000) and binary (KiB = 1024).
UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_ACCEPTED = "a positive int of bytes, or a number with a unit: B, KB, MB, GB, TB (decimal), KiB, MiB, GiB, TiB (binary), e.g. '40MB', '1.5GiB'"


def parse_size(value: str | int, name: str = "size") -> int:
    """Bytes in ``value``: an int, or a string such as ``"40MB"`` or ``"1.5GiB"``.

    Fractions round down to whole bytes. Zero, negative numbers, bool, NaN, infinity and
    unknown units raise ``ValueError`` (``TypeError`` for other types), naming ``name``.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a str, got bool: {value!r}; accepted: {_ACCEPTED}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _PATTERN.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or (unit and unit not in UNITS):
            raise ValueError(f"{name}={value!r} is not a size; accepted: {_ACCEPTED}")
        amount = float(match.group(1))
        size = math.floor(amount * UNITS[unit or "b"])
        if amount > 0 and size == 0:
            raise ValueError(f"{name}={value!r} is less than one byte; accepted: {_ACCEPTED}")
    else:
        raise TypeError(f"{name} must be an int or a str, got {type(value).__name__}: {value!r}; accepted: {_ACCEPTED}")
    if size <= 0:
        raise ValueError(f"{name}={value!r} is not accepted: a size must be more than 0 bytes; accepted: {_ACCEPTED}")
    return size
