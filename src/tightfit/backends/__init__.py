"""Backends: which devices this machine has, what they can do, and how much memory they hold.

Detection is lazy (importing tightfit touches no device), cached and thread-safe.
Built-in backends and plugins both register through the entry-point group
``tightfit.backends``.
"""

from tightfit.backends.base import FLOAT8_DTYPES, RUNTIME_HINTS, Backend, Capabilities, MemoryInfo
from tightfit.backends.registry import (
    ENTRY_POINT_GROUP,
    BackendEntry,
    all_backends,
    available,
    conflict,
    default,
    get,
    use,
)

__all__ = [
    "Backend",
    "BackendEntry",
    "Capabilities",
    "ENTRY_POINT_GROUP",
    "FLOAT8_DTYPES",
    "MemoryInfo",
    "RUNTIME_HINTS",
    "all_backends",
    "available",
    "conflict",
    "default",
    "get",
    "use",
]
