"""``tightfit.fit``: a model and a memory budget in, a :class:`FitPlan` out (per unit:
storage, placement, why; DFS hints for the layer stack where nothing else fits), with the
predicted device peak and time. See docs/fit.md.

The storages are the storage catalogue's formats (:func:`tightfit.quant.storage_formats`);
``STORAGES`` names them as the catalogue holds them now. ``Plan``, ``FitPlan``'s name
before, still works for one release with a DeprecationWarning.
"""

import warnings
from typing import Any

from tightfit.fitting.allow import Allow
from tightfit.fitting.calibration import Calibration, calibrate
from tightfit.fitting.held import held_bytes
from tightfit.fitting.options import PLACEMENTS, storage_names
from tightfit.fitting.plan import FitPlan, PlanEntry
from tightfit.fitting.planner import FitError, fit
from tightfit.fitting.regions import add_hints, remove_hints
from tightfit.fitting.size import parse_size

__all__ = [
    "PLACEMENTS",
    "STORAGES",
    "Allow",
    "Calibration",
    "FitError",
    "FitPlan",
    "PlanEntry",
    "add_hints",
    "calibrate",
    "fit",
    "held_bytes",
    "parse_size",
    "remove_hints",
    "storage_names",
]


def __getattr__(name: str) -> Any:
    if name == "STORAGES":  # read from the catalogue each time: a format registered later is in it
        return storage_names()
    if name == "Plan":
        warnings.warn(
            "tightfit.fitting.Plan is renamed FitPlan; Plan goes in the next release", DeprecationWarning, stacklevel=2
        )
        return FitPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
