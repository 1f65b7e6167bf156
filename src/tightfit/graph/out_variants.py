"""The ``out=`` variant of an aten op: the overload that writes its results into tensors
it is given, which is how arena execution puts a result where the plan says (not public).

An overload is the out variant of a functional one when it takes the same arguments
(names and types) plus one kwarg-only ``out`` tensor per result. It is only used on a
device whose dispatch key has a kernel for it: an ``out=`` variant that torch generates
from the functional op (a CompositeExplicitAutograd kernel) computes into a temporary and
copies it, which would allocate outside the arena after all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__: list[str] = []


@dataclass(frozen=True)
class OutVariant:
    """An op's out overload and the names of its ``out`` arguments, one per result."""

    op: torch._ops.OpOverload
    names: tuple[str, ...]


def _signature(schema: torch._C.FunctionSchema) -> list[tuple[str, str]]:
    return [(argument.name, str(argument.type)) for argument in schema.arguments if not argument.is_out]


@functools.cache
def _find(op: torch._ops.OpOverload) -> OutVariant | None:
    schema = op._schema
    if schema.is_mutable or not schema.returns:
        return None
    if any(str(result.type) != "Tensor" or result.alias_info is not None for result in schema.returns):
        return None  # a view, an in-place op, or results that are not plain tensors
    wanted = _signature(schema)
    packet = op.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        outs = [argument.name for argument in candidate._schema.arguments if argument.is_out]
        if len(outs) == len(schema.returns) and _signature(candidate._schema) == wanted:
            return OutVariant(candidate, tuple(outs))
    return None


@functools.cache
def _native(name: str, device_type: str) -> bool:
    key = torch._C._dispatch_key_for_device(device_type)
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, key))


def out_variant(target: object, device_type: str) -> tuple[OutVariant | None, str]:
    """The out variant of ``target`` that has a kernel for ``device_type``, else None and why not."""
    if not isinstance(target, torch._ops.OpOverload):
        return None, "not an aten op"
    found = _find(target)
    if found is None:
        return None, "no out= variant"
    if not _native(found.op.name(), device_type):
        return None, f"out= variant generated (computes, then copies) on {device_type}"
    return found, ""
