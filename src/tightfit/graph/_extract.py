"""Cut a run of nodes out of a graph into a GraphModule of its own (a split, or the body
of one slice), with fake-tensor metadata on every node (not public)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from tightfit.graph import _nodes

__all__: list[str] = []

Rewrite = Callable[[tuple[Any, ...], dict[str, Any], int], tuple[tuple[Any, ...], dict[str, Any]]]


def runtime_layout(fake: torch.Tensor) -> torch.Tensor:
    """The layout a value has once copied or preallocated: its own if dense, else contiguous."""
    if _nodes.is_dense(fake):
        return fake
    return torch.empty_like(fake, memory_format=torch.contiguous_format)


def _moved(args: Any, device: torch.device) -> Any:
    """Device arguments in a node's args/kwargs pointed at ``device``."""

    def move(leaf: Any) -> Any:
        return device if isinstance(leaf, torch.device) and leaf != device else leaf

    return torch.utils._pytree.tree_map(move, args)


def extract(
    root: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    inputs: Sequence[torch.fx.Node],
    outputs: Sequence[torch.fx.Node],
    example_inputs: Sequence[Any],
    *,
    device: torch.device | None = None,
    rewrites: dict[torch.fx.Node, Rewrite] | None = None,
    length: int | None = None,
) -> torch.fx.GraphModule:
    """A GraphModule computing ``outputs`` (as a tuple) from ``inputs`` with ``nodes``.

    ``example_inputs`` (fake tensors or plain values, one per input) become the
    placeholders' metadata and are propagated through the new graph, so every node's
    ``meta["val"]`` describes what it computes here (on ``device``, for one slice of
    ``length``, with ``rewrites`` applied to the nodes that have one).
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, example in zip(inputs, example_inputs):
        placeholder = graph.placeholder(node.name)
        placeholder.meta = {key: value for key, value in node.meta.items() if key not in ("val", "example_value")}
        placeholder.meta["val"] = example
        env[node] = placeholder
    for node in nodes:
        for arg in _nodes.input_nodes(node):
            if arg not in env and arg.op == "get_attr":
                env[arg] = graph.node_copy(arg)
        new = graph.node_copy(node, env.__getitem__)
        new.meta = copy.copy(node.meta)
        if rewrites and node in rewrites:
            new.args, new.kwargs = rewrites[node](new.args, dict(new.kwargs), length)
        if device is not None:
            new.args, new.kwargs = _moved(new.args, device), _moved(dict(new.kwargs), device)
        env[node] = new
    graph.output(tuple(env[node] for node in outputs))
    module = torch.fx.GraphModule(root, graph)
    fakes = [example for example in example_inputs if isinstance(example, torch.Tensor)]
    fake_mode = detect_fake_mode(fakes) if fakes else None
    if fake_mode is not None and (device is not None or length is not None):
        FakeTensorProp(module, mode=fake_mode).propagate_dont_convert_inputs(*example_inputs)
    return module
