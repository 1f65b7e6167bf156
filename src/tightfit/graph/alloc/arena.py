"""Offsets: place every buffer of one device in one arena so that no two buffers alive
at the same step overlap, and the arena is as small as we can make it.

Two strategies, the smaller arena kept (ties: greedy by size):

- greedy by size (TFLite's ``GreedyBySize``, ggml's approach): the largest buffers
  first, each at the lowest offset where it fits among the already placed buffers that
  are alive at the same time as it;
- best fit over time: walk the steps as an allocator would, freeing the buffers that
  died and giving each new buffer the smallest free hole that fits (growing the arena
  only when none does).

Every offset and every size is a multiple of ``alignment``. ("Placement" now names where
a node runs and where weights live; ``PLACEMENTS``, ``methods=`` and ``Arena.method``, the
strategies' names before, still work for one release with a DeprecationWarning.)
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tightfit._deprecation import renamed
from tightfit.graph.alloc.liveness import Buffer, align

__all__ = ["STRATEGIES", "Arena", "best_fit", "greedy_by_size", "place_arena"]

#: The arena strategies, in the order they are tried.
STRATEGIES = ("greedy-by-size", "best-fit")


@dataclass(frozen=True)
class Arena:
    """One device's arena: ``offsets[i]`` is where ``buffers[i]`` starts; ``strategy``: the one that found it."""

    device: str
    size: int
    alignment: int
    strategy: str
    buffers: tuple[Buffer, ...]
    offsets: tuple[int, ...]

    @property
    def method(self) -> str:
        """Deprecated: :attr:`strategy`."""
        warnings.warn(
            "Arena.method is renamed Arena.strategy; method goes in the next release", DeprecationWarning, stacklevel=2
        )
        return self.strategy

    def offset_of(self, name: str) -> int:
        """The offset of the buffer called ``name``."""
        for buffer, offset in zip(self.buffers, self.offsets):
            if buffer.name == name:
                return offset
        raise KeyError(f"no buffer called {name!r} in the arena of {self.device}")


def greedy_by_size(buffers: Sequence[Buffer], alignment: int) -> list[int]:
    """Offsets, largest buffers placed first, each at the lowest gap that fits."""
    count = len(buffers)
    sizes = np.array([align(b.nbytes, alignment) for b in buffers], dtype=np.int64)
    starts = np.array([b.start for b in buffers], dtype=np.int64)
    ends = np.array([b.end for b in buffers], dtype=np.int64)
    offsets = np.full(count, -1, dtype=np.int64)
    placed = np.zeros(count, dtype=bool)
    for index in sorted(range(count), key=lambda i: (-int(sizes[i]), int(starts[i]), i)):
        size = int(sizes[index])
        neighbours = np.nonzero(placed & (starts <= ends[index]) & (ends >= starts[index]))[0]
        spans = sorted(zip(offsets[neighbours].tolist(), (offsets[neighbours] + sizes[neighbours]).tolist()))
        offset = 0
        for low, high in spans:
            if low - offset >= size:
                break
            offset = max(offset, high)
        offsets[index] = offset
        placed[index] = True
    return offsets.tolist()


def best_fit(buffers: Sequence[Buffer], alignment: int) -> list[int]:
    """Offsets from a best-fit allocator that walks the steps: the smallest free hole that fits."""
    sizes = [align(b.nbytes, alignment) for b in buffers]
    offsets = [-1] * len(buffers)
    by_start: dict[int, list[int]] = {}
    by_end: dict[int, list[int]] = {}
    for index, buffer in enumerate(buffers):
        by_start.setdefault(buffer.start, []).append(index)
        by_end.setdefault(buffer.end, []).append(index)
    holes: list[list[int]] = []  # [offset, size], sorted by offset, never adjacent
    top = 0
    for step in sorted(set(by_start) | {end + 1 for end in by_end}):
        for index in by_end.get(step - 1, ()):
            top = _free(holes, offsets[index], sizes[index], top)
        for index in sorted(by_start.get(step, ()), key=lambda i: (-sizes[i], i)):
            size = sizes[index]
            fits = [hole for hole in holes if hole[1] >= size]
            if fits:
                hole = min(fits, key=lambda h: (h[1], h[0]))
                offsets[index] = hole[0]
                hole[0] += size
                hole[1] -= size
                if hole[1] == 0:
                    holes.remove(hole)
            elif holes and holes[-1][0] + holes[-1][1] == top:  # grow the arena from the last hole
                offsets[index] = holes[-1][0]
                top = holes[-1][0] + size
                holes.pop()
            else:
                offsets[index] = top
                top += size
    return offsets


def _free(holes: list[list[int]], offset: int, size: int, top: int) -> int:
    """Return ``[offset, offset + size)`` to the holes (merging neighbours); the new top."""
    if offset + size == top:
        top = offset
        if holes and holes[-1][0] + holes[-1][1] == top:
            top = holes.pop()[0]
        return top
    position = bisect.bisect_left([hole[0] for hole in holes], offset)
    holes.insert(position, [offset, size])
    if position + 1 < len(holes) and offset + size == holes[position + 1][0]:
        holes[position][1] += holes.pop(position + 1)[1]
    if position > 0 and holes[position - 1][0] + holes[position - 1][1] == offset:
        holes[position - 1][1] += holes.pop(position)[1]
    return top


_STRATEGIES = {"greedy-by-size": greedy_by_size, "best-fit": best_fit}


def place_arena(
    device: str,
    buffers: Sequence[Buffer],
    alignment: int = 64,
    strategies: Sequence[str] = STRATEGIES,
    **deprecated: Any,
) -> Arena:
    """The smallest arena the ``strategies`` find for ``buffers`` (all on ``device``).

    ``methods=``, the old name of ``strategies=``, works for one release with a DeprecationWarning.
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 1, got {alignment!r}")
    unknown = sorted(set(deprecated) - {"methods"})
    if unknown:
        raise TypeError(f"place_arena() got an unexpected keyword argument {unknown[0]!r}")
    if "methods" in deprecated:
        warnings.warn(
            "place_arena(methods=...) is renamed strategies=...; methods= goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        strategies = deprecated["methods"]
    best: Arena | None = None
    for strategy in strategies:
        if strategy not in _STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not known; known: {', '.join(STRATEGIES)}")
        offsets = _STRATEGIES[strategy](buffers, alignment)
        size = max((o + align(b.nbytes, alignment) for o, b in zip(offsets, buffers)), default=0)
        if best is None or size < best.size:
            best = Arena(device, size, alignment, strategy, tuple(buffers), tuple(offsets))
    return best


__getattr__ = renamed(__name__, PLACEMENTS=("STRATEGIES", lambda: STRATEGIES))
