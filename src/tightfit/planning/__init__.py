"""Deprecated: ``tightfit.planning`` is now :mod:`tightfit.memory` (kept for one release)."""

import warnings

from tightfit.memory.plan import DevicePlan, MemoryPlan, plan_memory

warnings.warn(
    "tightfit.planning is deprecated and will be removed in the next release; import from tightfit.memory "
    "(or use tightfit.plan_memory)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["DevicePlan", "MemoryPlan", "plan_memory"]
