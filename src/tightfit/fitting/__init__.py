"""``tightfit.fit``: a model and a memory budget in, a plan out (per unit: storage,
placement, why), with the predicted device peak and time. See docs/fit.md."""

from tightfit.fitting.allow import Allow
from tightfit.fitting.calibration import Calibration, calibrate
from tightfit.fitting.held import held_bytes
from tightfit.fitting.planner import FitError, fit
from tightfit.fitting.options import PLACEMENTS, STORAGES
from tightfit.fitting.plan import Plan, PlanEntry
from tightfit.fitting.size import parse_size

__all__ = ["Allow", "Calibration", "FitError", "PLACEMENTS", "Plan", "PlanEntry", "STORAGES", "calibrate", "fit", "held_bytes", "parse_size"]
