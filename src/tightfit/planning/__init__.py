"""``tightfit.plan_memory``: a static memory plan of a whole model (see docs/memory.md)."""

from tightfit.planning.plan import DevicePlan, MemoryPlan, plan_memory

__all__ = ["DevicePlan", "MemoryPlan", "plan_memory"]
