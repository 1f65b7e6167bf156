"""Accept PyTorch's ``hints_wrapper``: inline its body into the graph dynamo gives us and
put its hints on the body's nodes, before aot_autograd sees the graph.

``hints_wrapper`` has no autograd formula and inductor rejects it; inlined, its body is
ordinary graph code (so it trains) and its hints ride on the same metadata as
``tightfit.hint``. Its hints' keys follow tightfit's schema; a plain key the schema does
not know (``{"outer_body": True}``) is kept as ``"hints_wrapper.outer_body"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from tightfit.graph import _nodes
from tightfit.hints.payload import make_payload, new_region_id, payload_of, set_payload
from tightfit.hints.read import where
from tightfit.hints.schema import KNOWN_HINTS, canonical_hints

__all__ = ["inline_hints_wrappers"]


def _hints_wrapper() -> Any:
    from torch._higher_order_ops.hints_wrap import hints_wrapper

    return hints_wrapper


def _declared(hints: dict[str, Any], node: torch.fx.Node) -> tuple[tuple[str, Any], ...]:
    renamed = {
        key if key in KNOWN_HINTS or "." in key else f"hints_wrapper.{key}": value for key, value in hints.items()
    }
    try:
        return canonical_hints(renamed)
    except (TypeError, ValueError) as error:
        place = where(node)
        raise type(error)(f"hints_wrapper{f' at {place}' if place else ''}: {error}") from None


def _inline_one(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    graph = graph_module.graph
    body_ref, operands = node.args[0], node.args[1]
    hints = node.kwargs.get("hints", node.args[3] if len(node.args) > 3 else {})
    body = getattr(graph_module, body_ref.target)
    outer = payload_of(node)
    outer_chain = tuple(outer["chain"]) if outer else ()
    level = outer_chain + ((new_region_id(), _declared(dict(hints), node)),)
    env: dict[torch.fx.Node, Any] = {}
    body_inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    env.update(zip(body_inputs, operands))
    results: Any = ()
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = torch.fx.node.map_arg(inner.args[0], env.__getitem__)
                continue
            if inner.op == "get_attr":  # a nested hints_wrapper's body, or a constant
                name = _free_name(graph_module, inner.target)
                attribute = getattr(body, inner.target)
                if isinstance(attribute, torch.nn.Module):
                    graph_module.add_submodule(name, attribute)
                else:
                    setattr(graph_module, name, attribute)
                new = graph.get_attr(name)
                new.meta = dict(inner.meta)
            else:
                new = graph.node_copy(inner, env.__getitem__)
            set_payload(new, make_payload(level + _inside(payload_of(inner), outer_chain)))
            env[inner] = new
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    for user in list(node.users):
        if _nodes.is_getitem(user):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        else:
            raise ValueError(f"hints_wrapper output used as a whole by {user.name}; expected getitem")
    graph.erase_node(node)
    if not body_ref.users:
        graph.erase_node(body_ref)


def _inside(payload: dict[str, Any] | None, outer_chain: tuple[Any, ...]) -> tuple[Any, ...]:
    """The regions a body node sits in within the wrapper: dynamo traced the body inside
    the regions around the call too, so those (a common prefix) are dropped."""
    chain = tuple(payload["chain"]) if payload else ()
    shared = 0
    while shared < min(len(chain), len(outer_chain)) and chain[shared][0] == outer_chain[shared][0]:
        shared += 1
    return chain[shared:]


def _free_name(graph_module: torch.fx.GraphModule, base: str) -> str:
    name, index = base, 0
    while hasattr(graph_module, name):
        index += 1
        name = f"{base}_{index}"
    return name


def inline_hints_wrappers(graph_module: torch.fx.GraphModule) -> int:
    """Inline every ``hints_wrapper`` call (nested ones too); returns how many were inlined."""
    wrapper = _hints_wrapper()
    count = 0
    while True:
        node = next((n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is wrapper), None)
        if node is None:
            break
        _inline_one(graph_module, node)
        count += 1
    if count:
        graph_module.graph.lint()
        graph_module.delete_all_unused_submodules()
        graph_module.recompile()
    return count
