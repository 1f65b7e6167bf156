"""A module's real commands started side by side: each is still a fresh process, but they
import torch and run at once on the machine's cores instead of one after another; each
test waits for its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def side_by_side(calls: Mapping[str, Callable[[], T]]) -> Iterator[dict[str, Future[T]]]:
    """Each of ``calls`` (a function that runs one command) started at once, in a thread of
    its own; its future's ``.result()`` is what it returned, or raises what it raised."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        yield {name: pool.submit(call) for name, call in calls.items()}
