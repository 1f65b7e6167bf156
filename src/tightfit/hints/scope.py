"""``tightfit.hint(**hints)``: mark a region of user code, as a ``with`` block or a decorator.

Built on ``torch.fx.traceback.annotate`` (D5): while tracing (dynamo, aot_autograd,
export), every node created inside the region carries the hints in
``node.meta["custom"]["tightfit"]``. Eagerly, a hint changes nothing that runs.

Two functions below are marked constant for dynamo (what
``torch.compiler.assume_constant_result`` does, without importing dynamo at import
time): dynamo calls them while tracing instead of tracing into them, so validation and
the merge with enclosing regions run as plain Python and install no guards.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.fx.traceback as fx_traceback

from tightfit.hints.payload import HINT_KEY, nest
from tightfit.hints.schema import check_hints

__all__ = ["hint", "HintScope", "plain_python_frames"]

F = TypeVar("F", bound=Callable[..., Any])
_NONE = object()  # no "custom" entry was open


def _constant_for_dynamo(fn: F) -> F:
    """Mark ``fn`` as dynamo's ``assume_constant_result`` does (the same attribute)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@_constant_for_dynamo
def _checked(hints: dict[str, Any]) -> tuple[str | None, Any]:
    """("TypeError"/"ValueError", message) for bad hints, else (None, canonical items)."""
    error, detail = check_hints(hints)
    return (error.__name__ if error is not None else None), detail


@_constant_for_dynamo
def _entered(items: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """The ``custom`` annotation for a region entered now, nested in whatever is open."""
    custom = fx_traceback.current_meta.get("custom") or {}
    return {HINT_KEY: nest(custom.get(HINT_KEY), items)}


class HintScope:
    """What ``tightfit.hint(...)`` returns outside tracing: a context manager and a decorator.

    As a decorator the region opens at every call, so a function decorated once and
    called in several places makes one region per call, nested in the caller's.
    """

    def __init__(self, items: tuple[tuple[str, Any], ...]) -> None:
        self._items = items
        self._open = threading.local()

    @property
    def hints(self) -> dict[str, Any]:
        """The validated hints of this region."""
        return dict(self._items)

    # What ``fx_traceback.annotate`` does, written out. A scope made outside a compiled
    # function and entered inside it is a context manager dynamo cannot trace: dynamo
    # runs that function eagerly (hints are no-ops there). These two methods then run
    # as plain Python (see plain_python_frames); were dynamo to compile them as frames
    # of their own, they do nothing.
    def __enter__(self) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        previous = fx_traceback.current_meta.get("custom", _NONE)
        custom = dict(previous) if previous is not _NONE else {}
        custom.update(_entered(self._items))
        fx_traceback.current_meta["custom"] = custom
        self._open.__dict__.setdefault("stack", []).append(previous)

    def __exit__(self, *exc_info: Any) -> None:
        if torch.compiler.is_dynamo_compiling() or not getattr(self._open, "stack", None):
            return
        previous = self._open.stack.pop()
        if previous is _NONE:
            fx_traceback.current_meta.pop("custom", None)
        else:
            fx_traceback.current_meta["custom"] = previous

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"tightfit.hint(...) decorates a callable, got {type(fn).__name__}: {fn!r}")
        items = self._items

        @functools.wraps(fn)
        def hinted(*args: Any, **kwargs: Any) -> Any:
            with hint(**dict(items)):
                return fn(*args, **kwargs)

        return hinted  # type: ignore[return-value]

    def __repr__(self) -> str:
        inside = ", ".join(f"{key}={value!r}" for key, value in self._items)
        return f"tightfit.hint({inside})"


def hint(**hints: Any) -> Any:
    """Mark a region of code with hints a backend may honor (see docs/hints.md).

    ``with tightfit.hint(schedule="dfs", slices=8): ...`` or ``@tightfit.hint(order="as_written")``.
    Keys: those of the hint table, :data:`tightfit.hints.HINTS` (``schedule``, ``slices``,
    ``slice_dim``, ``device``, ``stream``, ``order``), and namespaced third-party keys
    ``"vendor.key"`` (pass them as ``**{"acme.tile": 128}``), carried untouched. Bad hints raise
    ``TypeError`` or ``ValueError`` here, where they are written. Nested regions merge;
    the inner one wins. In eager mode hints are no-ops: only graphs traced by
    ``torch.compile`` or ``torch.export`` carry them.
    """
    error, detail = _checked(hints)
    if error == "TypeError":
        raise TypeError(detail)
    if error is not None:
        raise ValueError(detail)
    if torch.compiler.is_dynamo_compiling():  # dynamo recognizes annotate() and enters it while tracing
        return fx_traceback.annotate(_entered(detail))
    return HintScope(detail)


def plain_python_frames() -> list[Any]:
    """Code objects dynamo must not compile as outermost frames (tightfit.graph._register)."""
    return [hint.__code__, HintScope.__enter__.__code__, HintScope.__exit__.__code__]
