"""Hints survive dynamo and aot_autograd, forward and backward, and strict export (D5)."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import tightfit
from tightfit.hints import node_hints, node_regions, owning_region


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        with tightfit.hint(schedule="dfs", slices=2, **{"acme.tile": 16}):
            h = h.softmax(-1) * 2
        return h.sum()


def test_hints_reach_forward_and_backward_graphs_after_aot_autograd():
    graphs = {}

    def keep(name):
        def compiler(graph_module, example_inputs):
            graphs[name] = graph_module
            return make_boxed_func(graph_module.forward)

        return compiler

    torch._dynamo.reset()
    model = Block()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
    compiled(torch.randn(4, 8, requires_grad=True)).backward()
    for name in ("forward", "backward"):
        regions = tightfit.hints_of(graphs[name])
        assert len(regions) == 1, name
        assert dict(regions[0].hints) == {"schedule": "dfs", "slices": 2, "acme.tile": 16}
        targets = {str(node.target) for node in graphs[name].graph.nodes if node.name in regions[0].nodes}
        assert any("softmax" in target for target in targets), (name, targets)
    forward_nodes = {node.name: node for node in graphs["forward"].graph.nodes}
    assert node_hints(forward_nodes["mm"] if "mm" in forward_nodes else forward_nodes["addmm"]) == {}
    assert node_regions(forward_nodes["_softmax"]) == (regions[0].id,)


def test_hints_reach_strict_export():
    exported = torch.export.export(Block(), (torch.randn(4, 8),), strict=True)
    regions = tightfit.hints_of(exported.graph_module)
    assert [dict(region.hints) for region in regions] == [{"schedule": "dfs", "slices": 2, "acme.tile": 16}]


def test_hints_of_accepts_graphs_and_rejects_other_things():
    graph = torch.fx.symbolic_trace(torch.nn.ReLU()).graph
    assert tightfit.hints_of(graph) == []
    with pytest.raises(TypeError, match="graph_module must be GraphModule or Graph, got Linear"):
        tightfit.hints_of(torch.nn.Linear(2, 2))


def test_owning_region_is_the_innermost_region_that_wrote_a_key():
    def fn(x):
        with tightfit.hint(schedule="dfs", slices=8):
            y = x.exp()
            with tightfit.hint(slices=2):  # owns the schedule of what it holds: it wrote slices
                z = y.sin()
                with tightfit.hint(device="cpu"):  # wrote no schedule key
                    return z.cos()

    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda graph_module, _: graphs.append(graph_module) or graph_module.forward)(
        torch.ones(2)
    )
    outer, middle, inner = tightfit.hints_of(graphs[0])
    nodes = {node.name: node for node in graphs[0].graph.nodes}
    schedule_keys = ("schedule", "slices", "slice_dim")
    assert owning_region(nodes["y"], schedule_keys) == outer.id
    assert owning_region(nodes["z"], schedule_keys) == owning_region(nodes[inner.nodes[0]], schedule_keys) == middle.id
    assert owning_region(nodes[inner.nodes[0]], ("device",)) == inner.id
    assert owning_region(nodes["z"], ("order",)) is None  # no region around it wrote that key
