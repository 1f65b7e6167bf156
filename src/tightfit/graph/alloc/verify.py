"""The verifier (D6): no two buffers alive at the same step overlap in their arena.

It checks a placement from scratch, not the code that made it: every offset is aligned
and inside the arena, and at every step the address ranges of the live buffers are
disjoint. The tests run it on every plan they make.
"""

from __future__ import annotations

from tightfit.graph.alloc.arena import Arena
from tightfit.graph.alloc.liveness import align

__all__ = ["PlanError", "verify_arena"]


class PlanError(RuntimeError):
    """A memory plan is wrong: two live buffers overlap, or one leaves its arena."""


def verify_arena(arena: Arena) -> None:
    """Raise :class:`PlanError` naming the first conflicts found in ``arena``; else return None."""
    problems = []
    if len(arena.offsets) != len(arena.buffers):
        raise PlanError(f"arena of {arena.device}: {len(arena.buffers)} buffers but {len(arena.offsets)} offsets")
    events: dict[int, list[int]] = {}
    for index, (buffer, offset) in enumerate(zip(arena.buffers, arena.offsets)):
        size = align(buffer.nbytes, arena.alignment)
        if offset < 0 or offset % arena.alignment:
            problems.append(f"{buffer.name} at offset {offset} is not a non-negative multiple of {arena.alignment}")
        if offset + size > arena.size:
            problems.append(f"{buffer.name} ends at {offset + size}, past the arena's {arena.size} bytes")
        if buffer.start > buffer.end:
            problems.append(f"{buffer.name} ends (step {buffer.end}) before it starts (step {buffer.start})")
        if buffer.device != arena.device:
            problems.append(f"{buffer.name} is on {buffer.device}, not {arena.device}")
        events.setdefault(buffer.start, []).append(index)
    live: set[int] = set()
    for step in sorted(events):
        live = {index for index in live if arena.buffers[index].end >= step}
        live.update(events[step])
        spans = sorted(
            (arena.offsets[i], arena.offsets[i] + align(arena.buffers[i].nbytes, arena.alignment), i)
            for i in live
            if arena.buffers[i].nbytes > 0
        )
        for (low, high, first), (next_low, _, second) in zip(spans, spans[1:]):
            if next_low < high:
                a, b = arena.buffers[first], arena.buffers[second]
                problems.append(
                    f"{a.name} [{low}, {high}) and {b.name} [{next_low}, ...) overlap at step {step} "
                    f"(alive {a.start}..{a.end} and {b.start}..{b.end})"
                )
        if len(problems) >= 5:
            break
    if problems:
        raise PlanError(f"arena of {arena.device} ({arena.strategy}, {arena.size} bytes): " + "; ".join(problems[:5]))
