"""Static memory planning (D6): lifetimes from the graph, the lower bound, offsets in one
arena per device, and a verifier that no two live tensors overlap.

- :mod:`~tightfit.graph.memory.liveness`: storages and their lifetimes (views and
  in-place results share their base's storage), :class:`Timeline`, the lower bound;
- :mod:`~tightfit.graph.memory.arena`: greedy-by-size and best-fit offsets, aligned;
- :mod:`~tightfit.graph.memory.verify`: the overlap check;
- :mod:`~tightfit.graph.memory.order`: memory-aware topological orders;
- :mod:`~tightfit.graph.memory.program`: a graph planned as the compile backend runs
  it, split by split;
- :mod:`~tightfit.graph.memory.layout`: which results arena execution writes into one
  buffer per device, where, and what it allocates outside.

``tightfit.plan_memory`` builds on these for a whole model; see docs/memory.md.
"""

from tightfit.graph.memory.arena import PLACEMENTS, Arena, best_fit, greedy_by_size, place_arena
from tightfit.graph.memory.layout import ARENA_ALIGNMENT, ArenaLayout, Outside, arena_layout
from tightfit.graph.memory.liveness import Buffer, Timeline, align, graph_timeline
from tightfit.graph.memory.order import ORDERS, apply_order, candidate_orders, choose_order
from tightfit.graph.memory.program import GraphPlan, join_training, plan_arenas, plan_graph
from tightfit.graph.memory.verify import PlanError, verify_arena

__all__ = [
    "ARENA_ALIGNMENT",
    "ORDERS",
    "PLACEMENTS",
    "Arena",
    "ArenaLayout",
    "Buffer",
    "GraphPlan",
    "Outside",
    "PlanError",
    "Timeline",
    "align",
    "apply_order",
    "arena_layout",
    "best_fit",
    "candidate_orders",
    "choose_order",
    "graph_timeline",
    "greedy_by_size",
    "join_training",
    "place_arena",
    "plan_arenas",
    "plan_graph",
    "verify_arena",
]
