"""Offsets in one arena: both strategies verified on random lifetimes; the verifier catches corruption."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tightfit.graph.alloc import Arena, Buffer, PlanError, Timeline, align, place_arena, verify_arena
from tightfit.graph.alloc.arena import best_fit, greedy_by_size


@st.composite
def lifetimes(draw):
    steps = draw(st.integers(1, 30))
    count = draw(st.integers(0, 40))
    found = []
    for index in range(count):
        start = draw(st.integers(0, steps - 1))
        end = draw(st.integers(start, steps - 1))
        found.append(Buffer(f"b{index}", "cpu", draw(st.integers(0, 5000)), start, end))
    return steps, found


def lower_bound(steps, found, alignment):
    timeline = Timeline(steps=[f"s{i}" for i in range(steps)], buffers=list(found))
    return timeline.lower_bound("cpu", alignment)


@settings(max_examples=150, deadline=None)
@given(lifetimes(), st.sampled_from([1, 16, 64]))
def test_every_strategy_is_valid_and_no_smaller_than_the_lower_bound(case, alignment):
    steps, found = case
    bound = lower_bound(steps, found, alignment)
    sizes = {}
    for strategy, place in (("greedy-by-size", greedy_by_size), ("best-fit", best_fit)):
        offsets = place(found, alignment)
        size = max((o + align(b.nbytes, alignment) for o, b in zip(offsets, found)), default=0)
        verify_arena(Arena("cpu", size, alignment, strategy, tuple(found), tuple(offsets)))
        assert size >= bound
        sizes[strategy] = size
    kept = place_arena("cpu", found, alignment)
    verify_arena(kept)
    assert kept.size == min(sizes.values())


def test_a_chain_of_layers_packs_into_its_lower_bound():
    """Each layer's output lives while the next is computed, with one large temporary inside each layer."""
    found = []
    for layer in range(6):
        found.append(Buffer(f"h{layer}", "cpu", 4096, 2 * layer, 2 * layer + 2))
        found.append(Buffer(f"t{layer}", "cpu", 16384, 2 * layer + 1, 2 * layer + 2))
    arena = place_arena("cpu", found, alignment=64)
    verify_arena(arena)
    assert arena.size == lower_bound(13, found, 64) == 4096 + 4096 + 16384


def _arena():
    found = (Buffer("a", "cpu", 128, 0, 2), Buffer("b", "cpu", 64, 1, 3), Buffer("c", "cpu", 64, 3, 4))
    arena = place_arena("cpu", found, alignment=64)
    verify_arena(arena)
    return arena


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda a: dataclasses.replace(a, offsets=(0, 64, a.offsets[2])), "overlap at step 1"),
        (
            lambda a: dataclasses.replace(a, offsets=(a.offsets[0], a.offsets[1] + 8, a.offsets[2])),
            "not a non-negative multiple of 64",
        ),
        (lambda a: dataclasses.replace(a, size=a.size - 64), "past the arena"),
        (lambda a: dataclasses.replace(a, offsets=a.offsets[:2]), "3 buffers but 2 offsets"),
        (
            lambda a: dataclasses.replace(
                a, buffers=(dataclasses.replace(a.buffers[0], device="cuda:0"),) + a.buffers[1:]
            ),
            "is on cuda:0",
        ),
    ],
)
def test_the_verifier_catches_a_corrupted_plan(corrupt, message):
    with pytest.raises(PlanError, match=message):
        verify_arena(corrupt(_arena()))


def test_bad_alignment_and_strategy_are_errors():
    with pytest.raises(ValueError, match="power of two"):
        place_arena("cpu", [], alignment=48)
    with pytest.raises(ValueError, match="not known"):
        place_arena("cpu", [], strategies=("first-fit",))
