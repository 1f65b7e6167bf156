"""PyTorch's hints_wrapper: inlined before autograd, its hints moved onto its body's nodes."""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.hints_wrap import hints_wrapper

import tightfit
from tightfit.graph import inline_hints_wrappers


def _dynamo_graph(fn, *args):
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch.compile(fn, backend=backend)(*args)
    return graphs[0]


def test_nested_hints_wrappers_and_tightfit_hints_merge():
    def fn(x):
        def inner(a):
            with tightfit.hint(order="as_written"):
                return a.relu() + 1

        def outer(a):
            return hints_wrapper(inner, (a.sin(),), {}, hints={"slices": 4, "outer_body": True})

        with tightfit.hint(schedule="dfs"):
            return hints_wrapper(outer, (x,), {}, hints={"slices": 2})

    graph = _dynamo_graph(fn, torch.randn(4))
    assert inline_hints_wrappers(graph) == 2
    assert not any("hints_wrapper" in str(node.target) for node in graph.graph.nodes)
    regions = tightfit.hints_of(graph)  # enclosing regions first
    innermost = regions[-1]
    assert dict(innermost.hints) == {
        "schedule": "dfs",
        "slices": 4,
        "hints_wrapper.outer_body": True,
        "order": "as_written",
    }
    assert [dict(region.declared) for region in regions] == [
        {"schedule": "dfs"},
        {"slices": 2},
        {"slices": 4, "hints_wrapper.outer_body": True},
        {"order": "as_written"},
    ]
    x = torch.randn(4)
    assert torch.equal(graph(x)[0], x.sin().relu() + 1)


def test_invalid_hints_wrapper_hints_are_rejected_naming_it():
    graph = _dynamo_graph(
        lambda x: hints_wrapper(lambda a: a * 2, (x,), {}, hints={"schedule": "wide"}), torch.randn(2)
    )
    with pytest.raises(ValueError, match=r"hints_wrapper at test_inline.py:\d+: hint schedule='wide' is not accepted"):
        inline_hints_wrappers(graph)
