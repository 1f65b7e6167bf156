"""The planner's quality term: a plan's expected error, and the bound it is held to.

Each storage format declares ``noise``: the relative RMS error a layer's output takes
from its weight stored so. A plan's expected error is the RMS of that over every weight
of the model (a weight kept as it is adds 0): ``sqrt(sum(numel * noise**2) / numel of
all)``. It ranks plans; it is not a perplexity (``benchmarks/quality.py`` measures
perplexity against it on a trained model).

The bound (``fit(..., max_error=)``, ``--max-error``) is what the planner may lose to
meet the budget: among the plans within the budget whose expected error is within the
bound, it takes the fastest. Without a bound the default, :data:`DEFAULT_MAX_ERROR`
(8-bit class: float8, 8-bit or int8 on every weight, or a little 4-bit), holds unless
the budget cannot be met within it; then the plan is the most precise one within the
budget, and says so (``FitPlan.quality``). A bound given is never exceeded: FitError
names the least error the budget allows instead.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["DEFAULT_MAX_ERROR", "expected_error", "parse_error", "percent"]

#: The expected error a plan may take when the caller gives no bound.
DEFAULT_MAX_ERROR = 0.03


def parse_error(value: Any, name: str = "max_error") -> float:
    """``value`` as a fraction in [0, 1]: a number (``0.03``) or a percentage string
    (``"3%"``); a ValueError naming ``name``, the value and what is accepted otherwise."""
    accepted = "a fraction in [0, 1] (0.03) or a percentage (3%)"
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            number = None
    else:
        raise TypeError(f"{name} must be a number or a percentage string, got {type(value).__name__}: {value!r}")
    if number is None or not math.isfinite(number) or not 0 <= number <= 1:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: {accepted}")
    return number


def expected_error(energy: float, weights: int) -> float:
    """The RMS of the per-weight error over ``weights`` weights whose squared errors sum
    to ``energy``."""
    return math.sqrt(energy / weights) if weights else 0.0


def percent(fraction: float) -> str:
    """``fraction`` as a percentage of three significant digits: ``0.03`` -> ``'3%'``."""
    return f"{fraction * 100:.3g}%"
