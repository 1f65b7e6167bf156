"""The graph runtime: ``torch.compile(model, backend="tightfit")`` assigns each op to a
backend, splits the graph where the backend changes, runs hinted regions by their
schedule (BFS or DFS over slices) and each split as compiled code or an FX module, or
(``memory="arena"``) op by op inside the arena the memory planner gives it.

See docs/compile.md. Passes: :mod:`~tightfit.graph.assign`,
:mod:`~tightfit.graph.schedules` (with the proof in :mod:`~tightfit.graph.slicing`),
:mod:`~tightfit.graph.partition`, :mod:`~tightfit.graph.execution`.
"""

from tightfit._deprecation import renamed
from tightfit.graph.assign import Assignment
from tightfit.graph.compile import CompileOptions, compile_graph, compiler, tightfit_backend
from tightfit.graph.execution import EXECUTIONS, MEMORY_MODES, Program, observe_splits
from tightfit.graph.inline import inline_hints_wrappers
from tightfit.graph.partition import Split
from tightfit.graph.schedules import SliceSchedule

__all__ = [
    "Assignment",
    "CompileOptions",
    "EXECUTIONS",
    "MEMORY_MODES",
    "Program",
    "SliceSchedule",
    "Split",
    "compile_graph",
    "compiler",
    "inline_hints_wrappers",
    "observe_splits",
    "tightfit_backend",
]

#: Old names kept for one release: "placement" now means where weights live (device, CPU,
#: disk), and "plan" the fit and memory plans.


__getattr__ = renamed(
    __name__, Placement=("Assignment", lambda: Assignment), SlicePlan=("SliceSchedule", lambda: SliceSchedule)
)
