"""Strict mode and the once-per-(op, device) fallback warning of decision D1."""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import warnings
from collections.abc import Iterator

from tightfit._errors import FallbackWarning, StrictModeError

__all__ = ["strict", "is_strict", "report_fallback", "report_slow_path"]

_STRICT = contextvars.ContextVar("tightfit_strict", default=None)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_warned: set[tuple[str, ...]] = set()
_warned_lock = threading.Lock()


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Within this block, a fallback raises StrictModeError instead of warning."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be bool, got {type(enabled).__name__}: {enabled!r}")
    token = _STRICT.set(enabled)
    try:
        yield
    finally:
        _STRICT.reset(token)


def is_strict() -> bool:
    """True inside ``strict()`` or when the environment sets TIGHTFIT_STRICT=1."""
    scoped = _STRICT.get()
    if scoped is not None:
        return scoped
    value = os.environ.get("TIGHTFIT_STRICT", "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"TIGHTFIT_STRICT={value!r} is not accepted; accepted: {', '.join(sorted(_TRUE | _FALSE - {''}))}")


def report_fallback(op: str, device: str, kind: str, detail: str) -> None:
    """Warn once per (op, device, kind) that a slower path runs; raise in strict mode.

    ``kind`` is "reference" (the pure-torch kernel on the device) or "cpu" (the op
    copied to the CPU and back).
    """
    report_slow_path((op, device, kind), f"tightfit op {op!r} on {device}: {detail}")


def report_slow_path(key: tuple[str, ...], message: str) -> None:
    """Warn once per ``key`` with ``message`` that a slower path runs; raise in strict mode."""
    if is_strict():
        raise StrictModeError(message + " (strict mode forbids fallbacks)")
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, FallbackWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside tightfit and torch: the user's line."""
    import torch

    internal = (_PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def _forget_warnings() -> None:
    """Let every fallback warn again (tests only)."""
    with _warned_lock:
        _warned.clear()
