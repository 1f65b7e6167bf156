"""``tightfit.fit``: a model and a memory budget in, a :class:`FitPlan` out (per unit:
storage, placement, why; DFS hints for the layer stack where nothing else fits), with the
predicted device peak and time. See docs/fit.md.

The storages are the storage catalogue's formats (:func:`tightfit.quant.storage_formats`);
``STORAGES`` names them as the catalogue holds them now. ``Plan``, ``FitPlan``'s name
before, still works for one release with a DeprecationWarning.
"""

from typing import Any

from tightfit._deprecation import renamed
from tightfit.fitting.allow import Allow
from tightfit.fitting.calibration import Calibration, calibrate
from tightfit.fitting.held import held_bytes
from tightfit.fitting.options import PLACEMENTS, storage_names
from tightfit.fitting.plan import FitPlan, PlanEntry
from tightfit.fitting.planner import FitError, fit
from tightfit.fitting.regions import add_hints, remove_hints
from tightfit.fitting.size import parse_size
from tightfit.fitting.traced import DecodeTrace

__all__ = [
    "PLACEMENTS",
    "STORAGES",
    "Allow",
    "Calibration",
    "DecodeTrace",
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


_renamed = renamed(__name__, Plan=("FitPlan", lambda: FitPlan))


def __getattr__(name: str) -> Any:
    if name == "STORAGES":  # read from the catalogue each time: a format registered later is in it
        return storage_names()
    return _renamed(name, stacklevel=3)
