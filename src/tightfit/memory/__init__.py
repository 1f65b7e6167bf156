"""How many bytes, predicted and measured, side by side.

- predicted: :func:`plan_memory` traces a model with fake tensors and simulates or plans
  its lifetimes (:mod:`~tightfit.memory.plan`, :mod:`~tightfit.memory.trace`,
  :mod:`~tightfit.memory.simulate`);
- measured: :func:`measure`, :func:`measure_training_step`, :func:`allocated_peak` (the allocator's own events, what
  every prediction is held to) and the live-tensor tracker (:mod:`~tightfit.memory.measure`,
  :mod:`~tightfit.memory.compiled`);
- one lifetime tracker under both: :class:`LiveTensorBytes` counts a real run, and runs
  the eager plan's simulation on fake tensors;
- shown: the report table and the PNG timelines (:mod:`~tightfit.memory.report`,
  :mod:`~tightfit.memory.plot`).

The arena allocator the compile backend runs is :mod:`tightfit.graph.alloc`.
"""

from tightfit.memory.measure import (
    AllocatedBytes,
    LiveTensorBytes,
    Measurement,
    MemoryTimeline,
    allocated_peak,
    mark,
    measure,
    tensor_bytes,
)
from tightfit.memory.plan import COVERS, LIMITS, NOT_COVERED, RUNTIMES, DevicePlan, MemoryPlan, plan_memory
from tightfit.memory.training_step import measure_training_step

__all__ = [
    "COVERS",
    "LIMITS",
    "NOT_COVERED",
    "RUNTIMES",
    "AllocatedBytes",
    "DevicePlan",
    "LiveTensorBytes",
    "Measurement",
    "MemoryPlan",
    "MemoryTimeline",
    "allocated_peak",
    "mark",
    "measure",
    "measure_training_step",
    "plan_memory",
    "tensor_bytes",
]
