"""Static memory planning (D6): lifetimes from the graph, the lower bound, offsets in one
arena per device, and a verifier that no two live tensors overlap.

- :mod:`~tightfit.graph.alloc.liveness`: storages and their lifetimes (views and
  in-place results share their base's storage), :class:`Timeline`, the lower bound;
- :mod:`~tightfit.graph.alloc.arena`: offsets, aligned, by two strategies (greedy by size, best fit);
- :mod:`~tightfit.graph.alloc.verify`: the overlap check;
- :mod:`~tightfit.graph.alloc.order`: memory-aware topological orders;
- :mod:`~tightfit.graph.alloc.program`: a graph planned as the compile backend runs
  it, split by split;
- :mod:`~tightfit.graph.alloc.layout`: which results arena execution writes into one
  buffer per device, where, and what it allocates outside.

``tightfit.plan_memory`` builds on these for a whole model; see docs/memory.md.
"""

from tightfit._deprecation import renamed
from tightfit.graph.alloc.arena import STRATEGIES, Arena, best_fit, greedy_by_size, place_arena
from tightfit.graph.alloc.layout import ARENA_ALIGNMENT, ArenaLayout, Outside, arena_layout
from tightfit.graph.alloc.liveness import Buffer, Timeline, align, graph_timeline
from tightfit.graph.alloc.order import (
    TOPOLOGICAL_ORDERS,
    apply_order,
    candidate_orders,
    canonical_order,
    choose_order,
)
from tightfit.graph.alloc.program import ScheduledGraph, join_training, plan_arenas, plan_graph
from tightfit.graph.alloc.verify import PlanError, verify_arena

__all__ = [
    "ARENA_ALIGNMENT",
    "STRATEGIES",
    "Arena",
    "ArenaLayout",
    "Buffer",
    "Outside",
    "PlanError",
    "ScheduledGraph",
    "TOPOLOGICAL_ORDERS",
    "Timeline",
    "align",
    "apply_order",
    "arena_layout",
    "best_fit",
    "candidate_orders",
    "canonical_order",
    "choose_order",
    "graph_timeline",
    "greedy_by_size",
    "join_training",
    "place_arena",
    "plan_arenas",
    "plan_graph",
    "verify_arena",
]

#: Old names kept for one release: "placement" names where nodes run and weights live, and
#: "plan" the fit and memory plans only.


__getattr__ = renamed(
    __name__,
    ORDERS=("TOPOLOGICAL_ORDERS (dfs, bfs: depth-first, breadth-first)", lambda: TOPOLOGICAL_ORDERS),
    PLACEMENTS=("STRATEGIES", lambda: STRATEGIES),
    GraphPlan=("ScheduledGraph", lambda: ScheduledGraph),
)
