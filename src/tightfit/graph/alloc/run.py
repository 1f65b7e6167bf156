"""Arena execution of one whole split: op by op, each result the plan placed in the arena
written by the op's ``out=`` variant into a view of the device's one arena buffer.

The offsets come from :func:`tightfit.graph.alloc.layout.arena_layout`: no two results
alive at the same time overlap there, so an offset is reused as soon as the plan says
its previous tenant is dead. Views and in-place results alias as they always do; the
ops the layout lists as outside allocate as usual. Values are freed after their last
use, inputs included (the call is boxed), as in an FX split.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from tightfit.graph import _nodes
from tightfit.graph.alloc.layout import ArenaLayout
from tightfit.graph.partition import Split

__all__ = ["ArenaRun"]


def _slot(arena: torch.Tensor, offset: int, fake: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and strided like ``fake`` at byte ``offset`` of ``arena`` (a uint8 buffer)."""
    typed = arena.view(fake.dtype)
    return typed.as_strided(
        tuple(fake.shape), tuple(fake.stride()), offset // fake.element_size() + fake.storage_offset()
    )


class ArenaRun:
    """Runs one whole split inside its device's arena; call with (inputs, arenas).

    ``inputs`` is the boxed list of the split's inputs (cleared); ``arenas`` maps a device
    to its arena buffer for this call of the graph: the first op that writes into it
    allocates it, the last one drops it (the views in it keep it alive to their end).
    """

    def __init__(self, split: Split, layout: ArenaLayout) -> None:
        if split.graph_module is None:
            raise ValueError(f"split {split.index} is a DFS split; arena execution runs whole splits")
        self.device = split.device
        self.size = layout.arena_bytes(str(split.device))
        closes = layout.closes.get(str(split.device))
        graph_module = split.graph_module
        graph = graph_module.graph
        self.placeholders = [node for node in graph.nodes if node.op == "placeholder"]
        self.output = next(node for node in graph.nodes if node.op == "output").args[0]
        self.constants = {
            node: _nodes.fetch_attr(graph_module, node.target) for node in graph.nodes if node.op == "get_attr"
        }
        last_use: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in graph.nodes:
            for arg in _nodes.input_nodes(node):
                last_use[arg] = node
        dead: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for value, user in last_use.items():
            if user.op != "output" and value not in self.constants:
                dead.setdefault(user, []).append(value)
        self.steps = []
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            slots = layout.slots.get(node.name)
            variant = layout.out_ops.get(node.name) if slots is not None else None
            fakes = _nodes.tensors(node) if variant is not None else []
            self.steps.append(
                (node, variant, tuple(zip(slots, fakes)) if variant else (), dead.get(node, []), node.name == closes)
            )

    def __call__(self, inputs: list[Any], arenas: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        env: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, inputs))
        inputs.clear()
        env.update(self.constants)
        key = str(self.device)
        arena = arenas.get(key)
        lookup = env.__getitem__
        for node, variant, slots, dead, closes in self.steps:
            args = torch.fx.node.map_arg(node.args, lookup)
            kwargs = torch.fx.node.map_arg(node.kwargs, lookup)
            if variant is None:
                env[node] = node.target(*args, **kwargs)
            else:
                if arena is None:
                    arena = arenas[key] = torch.empty(self.size, dtype=torch.uint8, device=self.device)
                outs = [
                    _nodes.allocate(fake, self.device) if offset is None else _slot(arena, offset, fake)
                    for offset, fake in slots
                ]
                kwargs = dict(kwargs, **dict(zip(variant.names, outs)))
                variant.op(*args, **kwargs)
                env[node] = outs[0] if len(outs) == 1 else tuple(outs)
                del outs
            del args, kwargs
            for value in dead:
                del env[value]
            if closes:  # nothing writes into the arena after this op: it dies with its last view
                arenas.pop(key, None)
                arena = None
        return tuple(torch.fx.node.map_arg(self.output, lookup))
