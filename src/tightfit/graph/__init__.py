"""The graph runtime: ``torch.compile(model, backend="tightfit")`` places each op on a
backend, splits the graph where the backend changes, runs hinted regions by their
schedule (BFS or DFS over slices) and each split as compiled code or an FX module, or
(``memory="arena"``) op by op inside the arena the memory planner gives it.

See docs/compile.md. Passes: :mod:`~tightfit.graph.placement`,
:mod:`~tightfit.graph.schedules` (with the proof in :mod:`~tightfit.graph.slicing`),
:mod:`~tightfit.graph.partition`, :mod:`~tightfit.graph.execution`.
"""

from tightfit.graph.compile import CompileOptions, compile_graph, compiler, tightfit_backend
from tightfit.graph.execution import EXECUTIONS, MEMORY_MODES, Program, observe_splits
from tightfit.graph.inline import inline_hints_wrappers
from tightfit.graph.partition import Split
from tightfit.graph.placement import Placement
from tightfit.graph.schedules import SlicePlan

__all__ = [
    "CompileOptions",
    "EXECUTIONS",
    "MEMORY_MODES",
    "Placement",
    "Program",
    "SlicePlan",
    "Split",
    "compile_graph",
    "compiler",
    "inline_hints_wrappers",
    "observe_splits",
    "tightfit_backend",
]
