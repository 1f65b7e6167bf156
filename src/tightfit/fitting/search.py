"""The search: one option per unit, predicted device peak within the budget, least
predicted time.

The peak is the bytes units hold + the largest of the planned activation peak, the
peak while a unit computes with its decoded weight (activations alive then + the
decoded copy) and, for a plan that covers loading, the peak while a unit streams in
and converts + the onloaded copies of two offloaded units (the one computing and the
one prefetched). The last two terms are maxima, not sums, so the search fixes a cap on
each (every distinct value an option has), keeps the options under the caps, and
solves the rest, a multiple-choice knapsack over held bytes, by dynamic programming on
bytes rounded up to buckets (so a solution it finds always fits). The best over all
caps wins.

A bound on the plan's error (:mod:`tightfit.fitting.quality`) is a second constraint,
over the options' summed ``error_energy``: relaxed into the objective (cost + weight x
energy), with the weight raised by bisection until the best plan meets the bound. Where
even the most precise plan within the budget does not, that one is returned (``forced``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tightfit.fitting.options import Option

__all__ = ["Choice", "Search", "peak_of", "search"]

_BUCKETS = 16384
_BISECTIONS = 20  # halvings of the error weight's logarithm (12 decades): within 0.003% of the least


def _value(choice: Choice, weight: float) -> float:
    return choice.cost + weight * choice.error_energy


@dataclass(frozen=True)
class Choice:
    """The chosen option index per unit and what it predicts: ``active_bytes`` is the
    activation peak, raised where a unit computes with a decoded weight (``compute_bytes``)
    or streams in (by the largest ``Option.load_bytes``, ``load_bytes``: the bound the
    search holds to the budget); ``load_peak_bytes`` is the exact peak while streaming in,
    the units in order, each above those loaded before it and the buffers of those still
    to come (computed by the skeleton, in memory from the start); ``peak_bytes`` covers it
    (a plan that does not cover loading has no use for it)."""

    picks: tuple[int, ...]
    held_bytes: int
    active_bytes: int
    onload_bytes: int
    seconds: float
    cost: float
    compute_bytes: int = 0
    load_bytes: int = 0
    load_peak_bytes: int = 0
    error_energy: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return max(self.held_bytes + self.active_bytes + self.onload_bytes, self.load_peak_bytes)


@dataclass(frozen=True)
class Search:
    """The best choice (None when nothing fits) and the least-peak choice (for the error);
    ``forced``: no choice within the budget meets the error bound, and ``best`` is the most
    precise one that fits."""

    best: Choice | None
    smallest: Choice
    forced: bool = False


def peak_of(options: list[list[Option]], picks: tuple[int, ...], activations: int, load_extra: int = 0) -> Choice:
    """What a choice predicts: held bytes summed, the activation peak raised by the
    largest compute or load peak, the two largest onloads, and the peak while streaming in:
    units in order (the rest last), each above the units before it and the buffers of
    those after it (``Option.ready_bytes``); ``load_extra``: bytes held only while
    loading (the load's reservations), above each unit's load."""
    chosen = [unit_options[pick] for unit_options, pick in zip(options, picks)]
    onloads = sorted((o.onload_bytes for o in chosen), reverse=True)[:2]
    computing = max([activations] + [o.compute_peak_bytes for o in chosen])
    loading = max([0] + [o.load_bytes for o in chosen]) + load_extra
    pending = sum(o.ready_bytes for o in chosen)  # in memory before the first unit is read
    load_peak = pending + load_extra
    held = 0
    for option in chosen:  # streamed in order, the rest last
        pending -= option.ready_bytes  # part of the unit's own bytes from here
        load_peak = max(load_peak, held + pending + option.held_bytes + option.load_bytes + load_extra)
        held += option.held_bytes
    return Choice(
        picks,
        held,
        max(computing, loading),
        sum(onloads),
        sum(o.seconds for o in chosen),
        sum(o.cost for o in chosen),
        computing,
        loading,
        load_peak,
        sum(o.error_energy for o in chosen),
    )


def _knapsack(
    options: list[list[Option]], allowed: list[list[int]], capacity: int, weight: float
) -> tuple[int, ...] | None:
    """Least cost + ``weight`` x error energy picks (among ``allowed`` indices) with held
    bytes <= capacity, or None."""
    if capacity < 0:
        return None
    bucket = max(1, math.ceil(capacity / _BUCKETS))
    size = capacity // bucket + 1
    best = np.zeros(size)  # least seconds with held bytes <= b buckets, for the units so far
    choices = []
    for unit_options, indices in zip(options, allowed):
        new = np.full(size, np.inf)
        pick = np.full(size, -1, dtype=np.int32)
        for index in indices:
            option = unit_options[index]
            held = math.ceil(option.held_bytes / bucket)
            if held >= size:
                continue
            shifted = np.full(size, np.inf)
            shifted[held:] = best[: size - held] + option.cost + weight * option.error_energy
            better = shifted < new
            new[better] = shifted[better]
            pick[better] = index
        best = new
        choices.append(pick)
    if not np.isfinite(best[-1]):
        return None
    picks, position = [], size - 1
    for unit_options, pick in zip(reversed(options), reversed(choices)):
        index = int(pick[position])
        picks.append(index)
        position -= math.ceil(unit_options[index].held_bytes / bucket)
    return tuple(reversed(picks))


def search(
    options: list[list[Option]], budget: int, activations: int, max_energy: float = math.inf, load_extra: int = 0
) -> Search:
    """Choose one option per unit so that the predicted peak is <= ``budget`` at the least
    summed cost (seconds, see :class:`Option`) with the summed error energy <=
    ``max_energy``; ``activations``: the planned activation peak with the inputs;
    ``load_extra``: bytes held only while loading (:func:`peak_of`). Every unit must have
    at least one option."""
    found = _search(options, budget, activations, 0.0, load_extra)
    if found.best is None or found.best.error_energy <= max_energy:
        return found
    # energy first: every weight-second of cost is worth less than any energy the options differ by
    steps = sorted({o.error_energy for unit in options for o in unit})
    least_step = min((b - a for a, b in zip(steps, steps[1:])), default=1.0)
    most_cost = sum(max(o.cost for o in unit) for unit in options)
    high = 2 * most_cost / least_step
    precise = _search(options, budget, activations, high, load_extra)
    if precise.best is None or precise.best.error_energy > max_energy:
        return Search(precise.best, found.smallest, forced=True)
    best, low = precise.best, high * 1e-12
    for _ in range(_BISECTIONS):  # geometric: the weight spans many orders of magnitude
        middle = math.sqrt(low * high)
        candidate = _search(options, budget, activations, middle, load_extra).best
        if candidate is not None and candidate.error_energy <= max_energy:
            high = middle
            best = candidate if candidate.cost < best.cost else best
        else:
            low = middle
    return Search(best, found.smallest)


def _search(options: list[list[Option]], budget: int, activations: int, weight: float, load_extra: int) -> Search:
    """The least cost + ``weight`` x error energy choice within ``budget`` (None when
    nothing fits), and the least-peak one; the knapsack leaves ``load_extra`` free."""
    active_caps = sorted(
        {activations} | {o.transient_bytes for unit in options for o in unit if o.transient_bytes > activations}
    )
    onload_caps = sorted({o.onload_bytes for unit in options for o in unit})
    best: Choice | None = None
    smallest: Choice | None = None
    for active_cap in active_caps:
        for onload_cap in onload_caps:
            allowed = [
                [i for i, o in enumerate(unit) if o.transient_bytes <= active_cap and o.onload_bytes <= onload_cap]
                for unit in options
            ]
            if not all(allowed):
                continue
            least = tuple(
                min(indices, key=lambda i, unit=unit: (unit[i].held_bytes, unit[i].cost))
                for unit, indices in zip(options, allowed)
            )
            candidate = peak_of(options, least, activations, load_extra)
            if smallest is None or candidate.peak_bytes < smallest.peak_bytes:
                smallest = candidate
            picks = _knapsack(options, allowed, budget - active_cap - 2 * onload_cap - load_extra, weight)
            if picks is None:
                continue
            choice = peak_of(options, picks, activations, load_extra)
            if choice.peak_bytes <= budget and (best is None or _value(choice, weight) < _value(best, weight)):
                best = choice
    return Search(best, smallest)
