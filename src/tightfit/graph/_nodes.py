"""Small facts about FX nodes that every pass needs (not public)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

__all__: list[str] = []


def op_names(node: torch.fx.Node) -> tuple[str, ...]:
    """Names a backend may list an op under: ("aten::bmm", "aten::bmm.default"), or the function's name."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        packet = target._schema.name
        return packet, f"{packet}.{target._overloadname}"
    name = getattr(target, "__name__", str(target))
    return (name,)


def op_name(node: torch.fx.Node) -> str:
    return op_names(node)[0]


def value(node: torch.fx.Node) -> Any:
    """The fake value a tracer left on the node (aot_autograd: "val", dynamo: "example_value")."""
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """The tensors a node produces (a multi-output op gives several)."""
    return [leaf for leaf in tree_flatten(value(node))[0] if isinstance(leaf, torch.Tensor)]


def device_of(node: torch.fx.Node) -> torch.device | None:
    produced = tensors(node)
    return produced[0].device if produced else None


def input_nodes(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """The distinct nodes a node reads, in argument order."""
    seen: set[torch.fx.Node] = set()
    for arg in tree_flatten((node.args, node.kwargs))[0]:
        if isinstance(arg, torch.fx.Node) and arg not in seen:
            seen.add(arg)
            yield arg


def is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and bool(target.is_view)


def is_getitem(node: torch.fx.Node) -> bool:
    import operator

    return node.op == "call_function" and node.target is operator.getitem


def tags(node: torch.fx.Node) -> tuple[Any, ...]:
    target = node.target
    return tuple(getattr(target, "tags", ())) if isinstance(target, torch._ops.OpOverload) else ()


def is_tensor_node(node: torch.fx.Node) -> bool:
    return bool(tensors(node))


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def is_dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: an allocation with exactly these strides is possible."""
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(tensor))


def fetch_attr(module: torch.nn.Module, target: str) -> Any:
    """The attribute a ``get_attr`` node names (dotted path) on ``module``."""
    for part in target.split("."):
        module = getattr(module, part)
    return module


def allocate(fake: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor like ``fake`` on ``device``: its strides if dense, else contiguous."""
    if is_dense(fake):
        return torch.empty_strided(tuple(fake.shape), tuple(fake.stride()), dtype=fake.dtype, device=device)
    return torch.empty(tuple(fake.shape), dtype=fake.dtype, device=device)
