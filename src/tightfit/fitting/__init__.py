"""``tightfit.fit``: a model and a memory budget in, a plan out (per unit: storage,
placement, why; DFS hints for the layer stack where nothing else fits), with the predicted device peak and time. See docs/fit.md."""

from tightfit.fitting.allow import Allow
from tightfit.fitting.calibration import Calibration, calibrate
from tightfit.fitting.held import held_bytes
from tightfit.fitting.planner import FitError, fit
from tightfit.fitting.options import PLACEMENTS, STORAGES
from tightfit.fitting.plan import Plan, PlanEntry
from tightfit.fitting.regions import add_hints, remove_hints
from tightfit.fitting.size import parse_size

__all__ = ["Allow", "Calibration", "FitError", "PLACEMENTS", "Plan", "PlanEntry", "STORAGES", "add_hints", "calibrate", "fit", "held_bytes", "parse_size",
           "remove_hints"]
