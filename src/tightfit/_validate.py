"""Argument checks for public entry points (D7): they raise, never assert, and name
the argument, the value received and what is accepted."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch

__all__: list[str] = []  # private helpers


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_type(name: str, value: Any, expected: type | tuple[type, ...]) -> None:
    """Raise TypeError unless ``value`` is an instance of ``expected``."""
    if not isinstance(value, expected):
        names = " or ".join(t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,)))
        raise TypeError(f"{name} must be {names}, got {type(value).__name__}: {_describe(value)}")


def check_choice(name: str, value: Any, choices: Collection[Any]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        accepted = ", ".join(sorted(map(str, choices)))
        raise ValueError(f"{name}={_describe(value)} is not accepted; accepted: {accepted}")


def check_same_device(name: str, value: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """Raise ValueError when two tensors live on different devices."""
    if value.device != other.device:
        raise ValueError(
            f"{name} is on {value.device} but {other_name} is on {other.device}; both must be on one device"
        )


def check_non_negative_number(name: str, value: Any) -> float:
    """A real number >= 0 (bool and NaN rejected), as float; an int past float's range is inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise ValueError(f"{name} must be a number >= 0, got {_describe(value)}")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_count(name: str, value: Any, least: int = 0) -> int:
    """``value`` as an int >= ``least`` (not a bool), or a clear error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {_describe(value)}")
    return value


def check_device(name: str, value: Any) -> torch.device:
    """A ``torch.device`` or a device string (``"cpu"``, ``"cuda:1"``), as torch.device."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name} must be torch.device or str, got {type(value).__name__}: {_describe(value)}")
    try:
        return torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{name}={value!r} is not a valid torch device (such as 'cpu' or 'cuda:0'): {error}") from None


def has_values(tensor: torch.Tensor) -> bool:
    """Whether a check can read ``tensor``'s values: not on meta, not a fake tensor (a
    skeleton converted to plan its memory has shapes only)."""
    from torch._subclasses.fake_tensor import is_fake

    return not tensor.is_meta and not is_fake(tensor)
