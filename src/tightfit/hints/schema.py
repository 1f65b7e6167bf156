"""The hint schema: which keys ``tightfit.hint`` accepts and what values each takes.

Checks run when a hint is written (D5). They never raise here: :func:`check_hints`
returns either the canonical hints or the error to raise, so that the caller can raise
it from code that ``torch.compile`` traces (an exception raised inside a function that
dynamo treats as a constant would reach the user wrapped in a dynamo error).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tightfit._validate import check_choice, check_type

__all__ = ["KNOWN_HINTS", "SCHEDULES", "ORDERS", "check_hints", "is_vendor_key", "canonical_hints"]

#: Schedules a region may ask for: run it whole, or slice by slice.
SCHEDULES = ("bfs", "dfs")
#: ``order``: keep the written order ("as_written"), or let the backend reorder ("any").
ORDERS = ("any", "as_written")
#: Keys tightfit defines, each with a one-line description (shown in errors and docs).
KNOWN_HINTS: dict[str, str] = {
    "schedule": "'bfs' (run the region whole) or 'dfs' (run it slice by slice)",
    "slices": "int >= 1: how many slices a 'dfs' region runs in",
    "slice_dim": "int (a dimension of the region's highest-rank inputs) or 'auto'",
    "device": "a backend name or device string ('cpu', 'cuda:1'), or a torch.device",
    "stream": "str or int: a side stream, on backends that have streams",
    "order": "'as_written' (keep the traced order) or 'any'",
}
_VENDOR_VALUE_TYPES = (type(None), bool, int, float, str)


def is_vendor_key(key: str) -> bool:
    """A namespaced third-party key such as ``"acme.tile"``: ``namespace.name``, both non-empty."""
    namespace, dot, name = key.partition(".")
    return bool(dot and namespace and name and namespace != "tightfit" and namespace.isidentifier()
                and all(part.isidentifier() for part in name.split(".")))


def _check_vendor_value(key: str, value: Any) -> None:
    leaves = value if isinstance(value, tuple) else (value,)
    for leaf in leaves:
        if not isinstance(leaf, _VENDOR_VALUE_TYPES):
            raise TypeError(f"hint {key}={value!r}: a namespaced hint's value must be None, bool, int, float, str "
                            f"or a tuple of those (so that it survives tracing and export), got {type(leaf).__name__}")


def _check_device(value: Any) -> str:
    check_type("hint device", value, (str, torch.device))
    text = str(value).strip()
    name, colon, index = text.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum() or (colon and not index.isdigit()):
        raise ValueError(f"hint device={value!r} is not a backend name or device string; "
                         "accepted: a backend name such as 'cpu' or 'cuda', or 'cuda:1'")
    return text


def _check_one(key: str, value: Any) -> Any:
    """The canonical value of one hint, or raise TypeError/ValueError naming it."""
    if key == "schedule":
        check_type("hint schedule", value, str)
        check_choice("hint schedule", value, SCHEDULES)
    elif key == "slices":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"hint slices must be int, got {type(value).__name__}: {value!r}")
        if value < 1:
            raise ValueError(f"hint slices={value} is not accepted; accepted: an int >= 1")
    elif key == "slice_dim":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"hint slice_dim must be int or 'auto', got {type(value).__name__}: {value!r}")
        if isinstance(value, str):
            check_choice("hint slice_dim", value, ("auto",))
    elif key == "device":
        return _check_device(value)
    elif key == "stream":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"hint stream must be str or int, got {type(value).__name__}: {value!r}")
    elif key == "order":
        check_type("hint order", value, str)
        check_choice("hint order", value, ORDERS)
    elif is_vendor_key(key):
        _check_vendor_value(key, value)
    else:
        known = ", ".join(KNOWN_HINTS)
        raise ValueError(f"hint {key!r} is not known; known hints: {known}; a third-party backend's hint "
                         "must be namespaced as 'vendor.key'")
    return value


def canonical_hints(hints: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Validated hints as a sorted tuple of (key, value); raises TypeError or ValueError."""
    check_type("hints", hints, Mapping)
    items = []
    for key, value in hints.items():
        check_type("hint name", key, str)
        items.append((key, _check_one(key, value)))
    return tuple(sorted(items))


def check_hints(hints: Mapping[str, Any]) -> tuple[type[Exception] | None, Any]:
    """``(None, canonical items)`` for valid hints, else ``(error type, message)``; never raises."""
    try:
        return None, canonical_hints(hints)
    except (TypeError, ValueError) as error:
        return type(error), str(error)
