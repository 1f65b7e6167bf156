"""Progress bars for the long steps of a run: loading weights, converting modules (private).

Library functions report their steps with :func:`task`; nothing is shown unless a caller
opened a display with :func:`show_progress` (``tightfit run`` does, on stderr, when stderr
is a terminal and ``--json`` is off). A library user therefore sees no bars and pays for
none; the display is per context, so threads do not draw into each other's bars.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__: list[str] = []

_DISPLAY: ContextVar[Any] = ContextVar("tightfit_progress", default=None)  # a rich Progress, or None


def _ignore(count: int = 1) -> None:
    """The advance of a task nobody watches."""


@contextmanager
def show_progress(console: Any) -> Iterator[None]:
    """Draw the tasks reported inside this block on ``console`` (a rich Console)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    token = _DISPLAY.set(progress)
    try:
        with progress:
            yield
    finally:
        _DISPLAY.reset(token)


@contextmanager
def task(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """One task of ``total`` steps; yields ``advance(count=1)``. Silent without a display."""
    progress = _DISPLAY.get()
    if progress is None:
        yield _ignore
        return
    handle = progress.add_task(description, total=total)
    try:
        yield lambda count=1: progress.advance(handle, count)
    finally:
        done = progress.tasks[handle].completed if total is None else total
        progress.update(handle, total=max(done, 1), completed=max(done, 1))


@contextmanager
def muted() -> Iterator[None]:
    """Tasks reported inside this block draw nothing: the steps of a task the caller shows itself."""
    token = _DISPLAY.set(None)
    try:
        yield
    finally:
        _DISPLAY.reset(token)


class _TqdmBar:
    """Enough of tqdm's interface for transformers' loading loop, drawn as a rich task."""

    def __init__(
        self, iterable: Iterable | None = None, desc: str | None = None, total: int | None = None, **_: Any
    ) -> None:
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self._iterable = iterable
        self._context = task(desc or "loading", total)
        self.update = self._context.__enter__()

    def __iter__(self) -> Iterator:
        try:
            for item in self._iterable or ():
                yield item
                self.update(1)
        finally:
            self.close()

    def close(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def __enter__(self) -> _TqdmBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        """Accepted and ignored: the task keeps its first description."""


@contextmanager
def transformers_bars() -> Iterator[None]:
    """Inside this block, transformers' own progress loops ("Loading weights") become rich tasks.

    transformers older than 5 has no tqdm hook; there the loading shows one task that
    completes when the block ends.
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its own tqdm bars: never, ours only where a display is open
    if _DISPLAY.get() is None:
        yield
        return
    if not hasattr(transformers_logging, "set_tqdm_hook"):
        with task("loading weights", None):
            yield
        return
    previous = transformers_logging.set_tqdm_hook(lambda factory, args, kwargs: _TqdmBar(*args, **kwargs))
    try:
        yield
    finally:
        transformers_logging.set_tqdm_hook(previous)
