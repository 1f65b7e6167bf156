"""Memory-aware orders: lower peaks where the written order is wasteful, never across what must stay put."""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import tightfit
from tightfit.graph.alloc import (
    TOPOLOGICAL_ORDERS,
    apply_order,
    candidate_orders,
    plan_arenas,
    plan_graph,
    verify_arena,
)
from tightfit.graph.alloc.liveness import check_order, storages_of


def traced(fn, *shapes):
    with FakeTensorMode(), fx_traceback.preserve_node_meta():  # hints reach the nodes
        return make_fx(fn)(*(torch.empty(shape) for shape in shapes))


def branches(x):
    """Three large temporaries, each reduced: written, all three are alive at once."""
    a, b, c = x * 2, x * 3, x * 4
    return a.sum() + b.sum() + c.sum()


def names(order):
    return [node.name for node in order]


def test_dfs_and_least_peak_first_cut_the_peak_of_parallel_branches_and_the_best_is_kept():
    graph_module = traced(branches, (1024,))
    plan = plan_graph(graph_module, alignment=64)
    big = 1024 * 4
    assert plan.order_peaks["written"] == plan.order_peaks["breadth-first"] >= 3 * big
    assert plan.order_peaks["depth-first"] < 2 * big and plan.order_peaks["least-peak"] < 2 * big
    assert plan.order == "depth-first"  # the lowest; ties go to the earlier candidate in TOPOLOGICAL_ORDERS
    check_order(graph_module.graph, plan.nodes)
    for arena in plan_arenas(plan.timeline, 64).values():
        verify_arena(arena)


def test_a_chosen_order_applied_to_the_graph_computes_the_same():
    graph_module = traced(branches, (1024,))
    plan = plan_graph(graph_module)
    apply_order(graph_module.graph, plan.nodes)
    graph_module.recompile()
    x = torch.randn(1024)
    torch.testing.assert_close(graph_module(x), branches(x))
    assert [n.name for n in graph_module.graph.nodes if n.op == "call_function"] == names(plan.nodes)


def _all_orders(graph_module):
    ops = [node for node in graph_module.graph.nodes if node.op == "call_function"]
    orders = candidate_orders(ops, storages_of(graph_module.graph))
    assert set(orders) == set(TOPOLOGICAL_ORDERS)
    for order in orders.values():
        check_order(graph_module.graph, order)
    return orders


def test_an_as_written_region_stays_together_and_in_order_in_every_candidate():
    def fn(x):
        a = x * 2
        with tightfit.hint(order="as_written"):
            c = x * 4
            d = x * 5
        b = x * 3
        return a.sum() + b.sum() + d.sum() + c.sum()

    graph_module = traced(fn, (256,))
    region = [node.name for node in graph_module.graph.nodes if tightfit.hints.node_hints(node).get("order")]
    assert region == ["mul_1", "mul_2"]
    for name, order in _all_orders(graph_module).items():
        found = names(order)
        start = found.index(region[0])
        assert found[start : start + len(region)] == region, name


def test_random_ops_keep_their_order_and_in_place_writes_keep_their_readers_on_their_side():
    def fn(x):
        first = torch.rand_like(x)
        second = torch.rand_like(x)
        a = x * 2
        before = a.sum()
        a.add_(1)
        after = a.sum()
        return second.sum() * 2 + first.sum() + before + after

    graph_module = traced(fn, (64,))
    for name, order in _all_orders(graph_module).items():
        found = names(order)
        assert found.index("rand_like") < found.index("rand_like_1"), name
        assert found.index("sum_1") < found.index("add_") < found.index("sum_2"), name
