"""Names the graph runtime renamed (issue 13: each word means one thing) still work for
one release, with a DeprecationWarning: "placement" is where weights live, "dfs"/"bfs"
are schedule hints, so the op-to-backend pass is an assignment and the topological
orders are "depth-first" and "breadth-first"."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import tightfit
from tightfit.graph import Assignment, SliceSchedule
from tightfit.graph.alloc import TOPOLOGICAL_ORDERS, plan_graph


@pytest.mark.parametrize("old, new", [("Placement", Assignment), ("SlicePlan", SliceSchedule)])
def test_old_class_names_warn_and_give_the_new_class(old, new):
    with pytest.warns(DeprecationWarning, match=f"tightfit.graph.{old} is renamed {new.__name__}"):
        assert getattr(tightfit.graph, old) is new


def test_old_orders_constant_warns():
    with pytest.warns(DeprecationWarning, match="tightfit.graph.alloc.ORDERS is renamed TOPOLOGICAL_ORDERS"):
        assert (
            tightfit.graph.alloc.ORDERS
            == TOPOLOGICAL_ORDERS
            == ("written", "depth-first", "breadth-first", "least-peak")
        )


def test_old_order_names_are_accepted_with_a_warning():
    graph_module = make_fx(lambda x: (x * 2).sum() + (x * 3).sum())(torch.ones(256))
    with pytest.warns(DeprecationWarning, match="order='dfs' is deprecated; use order='depth-first'") as caught:
        plan = plan_graph(graph_module, order="dfs")
    assert plan.order == "depth-first" and caught[0].filename == __file__  # blamed on the caller
    with pytest.warns(DeprecationWarning, match="order='bfs' is deprecated; use order='breadth-first'") as caught:
        memory = tightfit.plan_memory(torch.nn.Linear(4, 4), torch.ones(2, 4), order="bfs", backend="cpu")
    assert set(memory.orders.values()) == {"breadth-first"} and caught[0].filename == __file__
    with pytest.raises(ValueError, match="order='dfs2' is not accepted; accepted: best, breadth-first, depth-first"):
        plan_graph(graph_module, order="dfs2")
