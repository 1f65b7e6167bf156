"""The hint table: every key ``tightfit.hint`` accepts, in one row each (:data:`HINTS`).

A row names the key, describes it (errors and docs show that line), checks a value
and says which of tightfit's graph passes honor it. Everything else is read off the
table: the keys the in-tree backends declare (``tightfit.backends.RUNTIME_HINTS``, the
keys some pass honors) and the keys a pass treats as its own (:func:`keys_honored_by`).
Adding a key that the DFS pass honors is one row here plus the code in that pass.

Checks run when a hint is written (D5). They never raise here: :func:`check_hints`
returns either the canonical hints or the error to raise, so that the caller can raise
it from code that ``torch.compile`` traces (an exception raised inside a function that
dynamo treats as a constant would reach the user wrapped in a dynamo error).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from tightfit._validate import check_choice, check_type

__all__ = [
    "HINTS",
    "HINT_ORDERS",
    "HintSpec",
    "KNOWN_HINTS",
    "PASSES",
    "SCHEDULES",
    "canonical_hints",
    "check_hints",
    "is_vendor_key",
    "keys_honored_by",
]

#: Schedules a region may ask for: run it whole, or slice by slice.
SCHEDULES = ("bfs", "dfs")
#: ``order``: keep the written order ("as_written"), or let the backend reorder ("any").
HINT_ORDERS = ("any", "as_written")
#: tightfit's graph passes that honor hints (``HintSpec.honored_by`` names them).
PASSES = ("assignment", "schedules", "partition", "memory order")

_VENDOR_VALUE_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class HintSpec:
    """One hint key: ``doc`` (one line, shown in errors and docs), ``check`` (returns the
    canonical value, or raises TypeError/ValueError naming the hint) and ``honored_by``
    (the graph passes of :data:`PASSES` that carry it out; empty: none of tightfit's,
    only a backend's own ``_compile_split`` may)."""

    name: str
    doc: str
    check: Callable[[Any], Any]
    honored_by: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = [name for name in self.honored_by if name not in PASSES]
        if unknown:
            raise ValueError(
                f"HintSpec {self.name!r}: honored_by={self.honored_by!r} names no pass; accepted: {', '.join(PASSES)}"
            )


def _check_choice_of(key: str, choices: tuple[str, ...]) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        check_type(f"hint {key}", value, str)
        check_choice(f"hint {key}", value, choices)
        return value

    return check


def _check_slices(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"hint slices must be int, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ValueError(f"hint slices={value} is not accepted; accepted: an int >= 1")
    return value


def _check_slice_dim(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"hint slice_dim must be int or 'auto', got {type(value).__name__}: {value!r}")
    if isinstance(value, str):
        check_choice("hint slice_dim", value, ("auto",))
    return value


def _check_device(value: Any) -> str:
    check_type("hint device", value, (str, torch.device))
    text = str(value).strip()
    name, colon, index = text.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum() or (colon and not index.isdigit()):
        raise ValueError(
            f"hint device={value!r} is not a backend name or device string; "
            "accepted: a backend name such as 'cpu' or 'cuda', or 'cuda:1'"
        )
    return text


def _check_stream(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"hint stream must be str or int, got {type(value).__name__}: {value!r}")
    return value


#: The hint table, by key.
HINTS: Mapping[str, HintSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            HintSpec(
                "schedule",
                "'bfs' (run the region whole) or 'dfs' (run it slice by slice)",
                _check_choice_of("schedule", SCHEDULES),
                ("schedules", "partition"),
            ),
            HintSpec("slices", "int >= 1: how many slices a 'dfs' region runs in", _check_slices, ("schedules",)),
            HintSpec(
                "slice_dim",
                "int (a dimension of the region's highest-rank inputs) or 'auto'",
                _check_slice_dim,
                ("schedules",),
            ),
            HintSpec(
                "device",
                "a backend name or device string ('cpu', 'cuda:1'), or a torch.device",
                _check_device,
                ("assignment",),
            ),
            HintSpec("stream", "str or int: a side stream, on backends that have streams", _check_stream, ()),
            HintSpec(
                "order",
                "'as_written' (keep the traced order) or 'any'",
                _check_choice_of("order", HINT_ORDERS),
                ("partition", "memory order"),
            ),
        )
    }
)
#: Each key's one-line description (read off :data:`HINTS`).
KNOWN_HINTS: Mapping[str, str] = MappingProxyType({name: spec.doc for name, spec in HINTS.items()})


def keys_honored_by(graph_pass: str | None = None) -> frozenset[str]:
    """The keys a pass of :data:`PASSES` honors (None: the keys some pass honors)."""
    if graph_pass is not None:
        check_choice("graph_pass", graph_pass, PASSES)
    return frozenset(name for name, spec in HINTS.items() if spec.honored_by and graph_pass in (None, *spec.honored_by))


def is_vendor_key(key: str) -> bool:
    """A namespaced third-party key such as ``"acme.tile"``: ``namespace.name``, both non-empty."""
    namespace, dot, name = key.partition(".")
    return bool(
        dot
        and namespace
        and name
        and namespace != "tightfit"
        and namespace.isidentifier()
        and all(part.isidentifier() for part in name.split("."))
    )


def _check_vendor_value(key: str, value: Any) -> None:
    leaves = value if isinstance(value, tuple) else (value,)
    for leaf in leaves:
        if not isinstance(leaf, _VENDOR_VALUE_TYPES):
            raise TypeError(
                f"hint {key}={value!r}: a namespaced hint's value must be None, bool, int, float, str "
                f"or a tuple of those (so that it survives tracing and export), got {type(leaf).__name__}"
            )


def _check_one(key: str, value: Any) -> Any:
    """The canonical value of one hint, or raise TypeError/ValueError naming it."""
    spec = HINTS.get(key)
    if spec is not None:
        return spec.check(value)
    if not is_vendor_key(key):
        raise ValueError(
            f"hint {key!r} is not known; known hints: {', '.join(HINTS)}; a third-party backend's hint "
            "must be namespaced as 'vendor.key'"
        )
    _check_vendor_value(key, value)
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
