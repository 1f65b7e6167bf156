"""The proof behind a DFS rewrite: which dimension of every value in a region is the
sliced one, or why the region cannot be sliced.

A region runs as N slices only if every op in it works on each slice independently:
no op reduces over, or mixes elements across, the sliced dimension. This module
follows the sliced dimension from the region's inputs through every op with a rule
written for that op. An op without a rule, an op that reduces or mixes across the
dimension, or a random op makes the proof fail with a reason; nothing is assumed.

A value's state is :class:`Sliced` (dimension ``dim`` holds the sliced axis; a view
can merge the axis with dimensions around it, so that dimension has ``outer x extent x
unit`` elements, the axis being the middle factor), ``FULL`` (the same whole value for
every slice),
or :class:`Pending` (derived, through ops that only move data, from a region input
whose slicing is not decided yet). Inputs of the highest rank are sliced along the
hinted dimension; a lower-rank input is decided by the first op that needs it sliced
(a demand), and the propagation starts over; inputs nothing demands are FULL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from tightfit.graph import _nodes

__all__ = ["FULL", "Invalid", "Pending", "Proof", "Sliced", "prove", "put", "take"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Sliced:
    dim: int
    unit: int = 1  # elements of ``dim`` per index of the sliced axis (dims merged after it)
    outer: int = 1  # repeats of the axis within ``dim`` (dims merged before it)

    def at(self, dim: int) -> Sliced:
        return Sliced(dim, self.unit, self.outer)

    def size(self, length: int) -> int:
        """Elements of ``dim`` for a slice of ``length`` indices of the axis."""
        return self.outer * length * self.unit


def take(value: Any, state: Any, extent: int, start: int, length: int) -> Any:
    """Slice ``[start, start + length)`` of the axis from a whole value (a view when ``outer`` is 1)."""
    if not isinstance(state, Sliced):
        return value
    if state.outer == 1:
        return value.narrow(state.dim, start * state.unit, length * state.unit)
    split = value.unflatten(state.dim, (state.outer, extent * state.unit))
    return split.narrow(state.dim + 1, start * state.unit, length * state.unit).flatten(state.dim, state.dim + 1)


def put(result: torch.Tensor, piece: torch.Tensor, state: Sliced, extent: int, start: int, length: int) -> None:
    """Write one slice's ``piece`` into the whole ``result``."""
    if state.outer == 1:
        result.narrow(state.dim, start * state.unit, length * state.unit).copy_(piece)
        return
    target = result.unflatten(state.dim, (state.outer, extent * state.unit))
    target = target.narrow(state.dim + 1, start * state.unit, length * state.unit)
    target.copy_(piece.unflatten(state.dim, (state.outer, length * state.unit)))


@dataclass(frozen=True)
class Pending:
    root: torch.fx.Node
    path: tuple[torch.fx.Node, ...] = ()


FULL = None
State = Any  # Sliced | Pending | None | tuple of those (multi-output ops)
Rewrite = Callable[[tuple[Any, ...], dict[str, Any], int], tuple[tuple[Any, ...], dict[str, Any]]]


class Invalid(Exception):
    """The region cannot be sliced; the message says which op and why."""


class _Restart(Exception):
    """A region input was decided; propagate again."""


@dataclass
class Proof:
    """States of every region value for one choice of sliced dimension."""

    extent: int
    states: dict[torch.fx.Node, State]
    rewrites: dict[torch.fx.Node, Rewrite] = field(default_factory=dict)


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    value = _nodes.value(node)
    if not isinstance(value, torch.Tensor):
        raise Invalid(f"{node.name} is not a single tensor")
    return tuple(value.shape)


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _named(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by their schema names."""
    names = [argument.name for argument in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [arg for arg in _nodes.input_nodes(node) if isinstance(_nodes.value(arg), torch.Tensor)]


# -- data-movement ops: an axis map forward (input state -> output) and back ---------------
def _view_map(src: Sequence[int], dst: Sequence[int], state: Sliced, extent: int) -> Sliced | None:
    """Where the sliced axis lands after a row-major reshape from ``src`` to ``dst``.

    Flat indices are ((o * extent) + axis) * inner + i: the axis stays whole in one
    dimension j of ``dst`` when the dimensions before j split ``before`` evenly and
    those after j split ``inner`` evenly.
    """
    before = math.prod(src[: state.dim]) * state.outer
    inner = state.unit * math.prod(src[state.dim + 1 :])
    for j, size in enumerate(dst):
        head, tail = math.prod(dst[:j]), math.prod(dst[j + 1 :])
        if before % head == 0 and inner % tail == 0 and size == (before // head) * extent * (inner // tail):
            return Sliced(j, inner // tail, before // head)
    return None


def _axis_map(node: torch.fx.Node, state: Sliced, extent: int, forward: bool) -> Sliced | None:
    """Map a sliced axis through one data-movement op (None: it cannot be followed)."""
    src, dst = _shape(node.args[0]), _shape(node)
    if not forward:
        src, dst = dst, src
    target = node.target
    if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return _view_map(src, dst, state, extent)
    if target is aten.expand.default:
        shift = len(dst) - len(src)
        dim = state.dim + shift if forward else state.dim - shift
        if dim < 0 or src[state.dim] != dst[dim]:
            return None
        return state.at(dim)
    if target is aten.permute.default:
        dims = [_norm(d, len(src)) for d in node.args[1]]
        return state.at(dims.index(state.dim) if forward else dims[state.dim])
    if target in (aten.transpose.int, aten.t.default):
        a, b = (_norm(node.args[1], len(src)), _norm(node.args[2], len(src))) if len(node.args) > 1 else (0, 1)
        swap = {a: b, b: a}
        return state.at(swap.get(state.dim, state.dim))
    if target is aten.unsqueeze.default:
        d = _norm(node.args[1], len(_shape(node)))
        if forward:
            return state.at(state.dim + (1 if state.dim >= d else 0))
        return None if state.dim == d else state.at(state.dim - (1 if state.dim > d else 0))
    if target in (aten.select.int, aten.slice.Tensor, aten.squeeze.dim, aten.squeeze.dims):
        return _drop_map(node, src, dst, state, forward)
    return state  # identity: same shape, same layout of the axis


def _drop_map(
    node: torch.fx.Node, src: Sequence[int], dst: Sequence[int], state: Sliced, forward: bool
) -> Sliced | None:
    """select / slice / squeeze: ops that index or drop dimensions other than the sliced one."""
    rank_in = len(_shape(node.args[0]))
    if node.target is aten.squeeze.dims or node.target is aten.squeeze.dim:
        given = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dropped = {_norm(d, rank_in) for d in given if _shape(node.args[0])[_norm(d, rank_in)] == 1}
    elif node.target is aten.select.int:
        dropped = {_norm(node.args[1], rank_in)}
    else:  # slice.Tensor keeps every dimension
        return state
    if forward:
        if state.dim in dropped:
            return None
        return state.at(state.dim - sum(1 for d in dropped if d < state.dim))
    kept = [d for d in range(rank_in) if d not in dropped]
    return state.at(kept[state.dim])


_MOVEMENT = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.select.int,
    aten.slice.Tensor,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.lift_fresh_copy.default,
    aten.contiguous.default,
}
_SIZE_ARG = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}


class _Propagation:
    def __init__(self, nodes: Sequence[torch.fx.Node], seeds: dict[torch.fx.Node, State], extent: int) -> None:
        self.nodes = nodes
        self.inside = set(nodes)
        self.extent = extent
        self.states: dict[torch.fx.Node, State] = dict(seeds)
        self.rewrites: dict[torch.fx.Node, Rewrite] = {}
        self.decided: dict[torch.fx.Node, State] = {}

    def state(self, node: torch.fx.Node) -> State:
        if node in self.states:
            return self.states[node]
        return FULL  # a constant or a non-tensor from outside

    def demand(self, node: torch.fx.Node, wanted: Sliced, by: torch.fx.Node) -> None:
        """``by`` needs ``node`` sliced as ``wanted``: decide the pending input it comes from."""
        state = self.state(node)
        if not isinstance(state, Pending):
            raise Invalid(
                f"{by.name} ({_nodes.op_name(by)}) combines sliced data with {node.name}, "
                "which is the same for every slice, along the sliced dimension"
            )
        for step in reversed(state.path):
            wanted = _axis_map(step, wanted, self.extent, forward=False)
            if wanted is None:
                raise Invalid(
                    f"cannot slice {state.root.name} so that {by.name} gets {node.name} sliced "
                    f"(through {step.name}, {_nodes.op_name(step)})"
                )
        if _shape(state.root)[wanted.dim] != wanted.size(self.extent):
            raise Invalid(
                f"{by.name} needs {state.root.name} sliced along its dim {wanted.dim}, which has "
                f"{_shape(state.root)[wanted.dim]} elements, not {wanted.outer} x {self.extent} x {wanted.unit}"
            )
        self.decided[state.root] = wanted
        raise _Restart

    def run(self) -> None:
        for node in self.nodes:
            self.states[node] = self.visit(node)

    def visit(self, node: torch.fx.Node) -> State:
        if _nodes.is_getitem(node):
            source = self.state(node.args[0])
            return source[node.args[1]] if isinstance(source, tuple) else source
        operands = _tensor_args(node)
        states = [self.state(arg) for arg in operands]
        sliced = [s for s in states if isinstance(s, Sliced)]
        if not sliced:
            if node.target in _MOVEMENT and len(operands) == 1 and isinstance(states[0], Pending):
                return Pending(states[0].root, states[0].path + (node,))
            return FULL  # depends on nothing sliced: the same for every slice (hoisted)
        if torch.Tag.nondeterministic_seeded in _nodes.tags(node):
            raise Invalid(f"{node.name} ({_nodes.op_name(node)}) draws random numbers; slicing would change them")
        rule = _RULES.get(node.target)
        if rule is None:
            if torch.Tag.pointwise in _nodes.tags(node):
                rule = _pointwise
            elif node.target in _MOVEMENT:
                rule = _movement
            else:
                raise Invalid(f"{node.name} ({_nodes.op_name(node)}) has no slicing rule")
        return rule(self, node)


# -- rules: (propagation, node) -> output state ------------------------------------------
def _movement(p: _Propagation, node: torch.fx.Node) -> State:
    state = p.state(node.args[0])
    mapped = _axis_map(node, state, p.extent, forward=True)
    if mapped is None:
        raise Invalid(f"{node.name} ({_nodes.op_name(node)}) indexes or reshapes across the sliced dimension")
    if node.target is aten.slice.Tensor and _norm(node.args[1], len(_shape(node.args[0]))) == state.dim:
        raise Invalid(f"{node.name} slices along the sliced dimension")
    if node.target in _SIZE_ARG:

        def resize(
            args: tuple[Any, ...], kwargs: dict[str, Any], length: int
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            size = list(args[1])
            if size[mapped.dim] != -1:
                size[mapped.dim] = mapped.size(length)
            return (args[0], size, *args[2:]), kwargs

        p.rewrites[node] = resize
    return mapped


def _broadcast(
    p: _Propagation, node: torch.fx.Node, operands: Sequence[torch.fx.Node], out_shape: Sequence[int]
) -> Sliced:
    """Operands combined element by element (with broadcasting): the sliced axes must line up."""
    position = first = None
    for arg in operands:
        state = p.state(arg)
        if isinstance(state, Sliced):
            here = len(_shape(arg)) - state.dim  # counted from the right, as broadcasting aligns
            if position is None:
                position, first = here, state
            elif here != position or state.at(0) != first.at(0):
                raise Invalid(
                    f"{node.name} ({_nodes.op_name(node)}) combines operands sliced along different dimensions"
                )
    for arg in operands:
        state, shape = p.state(arg), _shape(arg)
        if isinstance(state, Sliced) or len(shape) < position or shape[len(shape) - position] == 1:
            continue
        p.demand(arg, first.at(len(shape) - position), node)
    return first.at(len(out_shape) - position)


def _alike(p: _Propagation, node: torch.fx.Node, operands: Sequence[torch.fx.Node]) -> Sliced:
    """Operands that must all be sliced the same way (pending ones are made so)."""
    first = next(p.state(arg) for arg in operands if isinstance(p.state(arg), Sliced))
    for arg in operands:
        state = p.state(arg)
        if state != first:
            if isinstance(state, Sliced):
                raise Invalid(f"{node.name} ({_nodes.op_name(node)}) gets operands sliced differently")
            p.demand(arg, first, node)
    return first


def _pointwise(p: _Propagation, node: torch.fx.Node) -> State:
    return _broadcast(p, node, _tensor_args(node), _shape(node))


def _reduction(p: _Propagation, node: torch.fx.Node) -> State:
    named = _named(node)
    source = node.args[0]
    state, rank = p.state(source), len(_shape(source))
    dims, keepdim = named.get("dim"), bool(named.get("keepdim", False))
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        raise Invalid(f"{node.name} ({_nodes.op_name(node)}) reduces over every dimension, the sliced one too")
    dims = {_norm(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    if state.dim in dims:
        raise Invalid(f"{node.name} ({_nodes.op_name(node)}) reduces over the sliced dimension")
    out = state.at(state.dim if keepdim else state.dim - sum(1 for d in dims if d < state.dim))
    return (out, out) if isinstance(_nodes.value(node), (tuple, list)) else out


def _along(dim_index: int) -> Callable[[_Propagation, torch.fx.Node], State]:
    """Ops that work along one dimension given at args[dim_index] (softmax and its backward)."""

    def rule(p: _Propagation, node: torch.fx.Node) -> State:
        out = _broadcast(p, node, _tensor_args(node), _shape(node))
        if _norm(node.args[dim_index], len(_shape(node))) == out.dim:
            raise Invalid(f"{node.name} ({_nodes.op_name(node)}) normalizes along the sliced dimension")
        return out

    return rule


def _matmul(batch: bool, bias: bool) -> Callable[[_Propagation, torch.fx.Node], State]:
    """mm / bmm (and addmm / baddbmm): a[.., n, k] @ b[.., k, m]. The contracted k is never sliced."""

    def rule(p: _Propagation, node: torch.fx.Node) -> State:
        first = 1 if bias else 0  # addmm(bias, a, b)
        a, b = node.args[first], node.args[first + 1]
        sa, sb = p.state(a), p.state(b)
        off = 1 if batch else 0
        if batch and (isinstance(sa, Sliced) and sa.dim == 0 or isinstance(sb, Sliced) and sb.dim == 0):
            out = _alike(p, node, (a, b))  # the same batches of both
        elif isinstance(sa, Sliced) and sa.dim == off and not isinstance(sb, Sliced):
            out = sa  # rows of a: the same rows of the product
        elif isinstance(sb, Sliced) and sb.dim == off + 1 and not isinstance(sa, Sliced):
            out = sb  # columns of b: the same columns of the product
        else:
            raise Invalid(
                f"{node.name} ({_nodes.op_name(node)}) sums over (or pairs rows and columns of) the sliced dimension"
            )
        if bias:
            _check_broadcast_full(p, node, node.args[0], out, _shape(node))
        return out

    return rule


def _check_broadcast_full(
    p: _Propagation, node: torch.fx.Node, arg: Any, out: Sliced, out_shape: Sequence[int]
) -> None:
    if not isinstance(arg, torch.fx.Node):
        return
    shape, position = _shape(arg), len(out_shape) - out.dim
    if isinstance(p.state(arg), Sliced):
        if p.state(arg) != out.at(len(shape) - position):
            raise Invalid(f"{node.name} ({_nodes.op_name(node)}) adds an operand sliced along another dimension")
    elif len(shape) >= position and shape[len(shape) - position] != 1:
        p.demand(arg, out.at(len(shape) - position), node)


def _layer_norm(p: _Propagation, node: torch.fx.Node) -> State:
    source, normalized = node.args[0], node.args[1]
    state = p.state(source)
    if not isinstance(state, Sliced) or state.dim >= len(_shape(source)) - len(normalized):
        raise Invalid(f"{node.name} (layer norm) normalizes over the sliced dimension")
    for arg in _tensor_args(node)[1:]:
        if isinstance(p.state(arg), Sliced):
            raise Invalid(f"{node.name} (layer norm) has a sliced weight or bias")
    return (state, state, state)


def _attention(p: _Propagation, node: torch.fx.Node) -> State:
    """Fused attention (and its backward): batch and heads (dims 0, 1) are independent."""
    named = _named(node)
    if named.get("dropout_p", 0.0):
        raise Invalid(f"{node.name} uses dropout; slicing would change its random numbers")
    mask = named.get("attn_mask")
    operands = [arg for arg in _tensor_args(node) if arg is not mask]
    first = _alike(p, node, operands)
    if first.dim > 1:
        raise Invalid(f"{node.name} ({_nodes.op_name(node)}) mixes along its sequence dimensions")
    if isinstance(mask, torch.fx.Node):
        _check_broadcast_full(p, node, mask, first, _shape(operands[0])[:-1] + (_shape(operands[1])[-2],))
    outputs = _nodes.value(node)
    return (
        tuple(first if isinstance(o, torch.Tensor) else FULL for o in outputs)
        if isinstance(outputs, (tuple, list))
        else first
    )


def _cat(p: _Propagation, node: torch.fx.Node) -> State:
    parts = node.args[0]
    dim = _norm(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(_shape(node)))
    first = _alike(p, node, parts)
    if first.dim == dim:
        raise Invalid(f"{node.name} concatenates along the sliced dimension")
    return first


_RULES: dict[Any, Callable[[_Propagation, torch.fx.Node], State]] = {
    aten.mm.default: _matmul(batch=False, bias=False),
    aten.addmm.default: _matmul(batch=False, bias=True),
    aten.bmm.default: _matmul(batch=True, bias=False),
    aten.baddbmm.default: _matmul(batch=True, bias=True),
    aten._softmax.default: _along(1),
    aten._log_softmax.default: _along(1),
    aten._softmax_backward_data.default: _along(2),
    aten._log_softmax_backward_data.default: _along(2),
    aten.masked_fill.Tensor: _pointwise,
    aten.masked_fill.Scalar: _pointwise,
    aten.native_layer_norm.default: _layer_norm,
    aten.cat.default: _cat,
    aten.sum.dim_IntList: _reduction,
    aten.mean.dim: _reduction,
    aten.amax.default: _reduction,
    aten.amin.default: _reduction,
    aten.max.dim: _reduction,
    aten.min.dim: _reduction,
    aten.var.correction: _reduction,
    aten.logsumexp.default: _reduction,
}
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
    if hasattr(aten, _name):  # the fused CPU attention; GPU variants also return RNG state, not sliced here
        _RULES[getattr(aten, _name).default] = _attention


def _seeds(inputs: Sequence[torch.fx.Node], dim: int) -> tuple[dict[torch.fx.Node, State], int]:
    """Highest-rank inputs sliced along ``dim`` (the first one's size there is the extent);
    others pending, to be decided by the ops that read them."""
    rank = max(len(_shape(arg)) for arg in inputs)
    dim = _norm(dim, rank)
    if not 0 <= dim < rank:
        raise Invalid(f"slice_dim={dim} is outside the region inputs' {rank} dimensions")
    extent = next((_shape(arg)[dim] for arg in inputs if len(_shape(arg)) == rank and _shape(arg)[dim] > 1), 1)
    seeds: dict[torch.fx.Node, State] = {}
    for arg in inputs:
        shape = _shape(arg)
        if len(shape) == rank and shape[dim] == extent:
            seeds[arg] = Sliced(dim)
        elif len(shape) == rank and shape[dim] == 1:
            seeds[arg] = FULL
        else:
            seeds[arg] = Pending(arg)
    return seeds, extent


def prove(nodes: Sequence[torch.fx.Node], inputs: Sequence[torch.fx.Node], dim: int) -> Proof:
    """States of every node in ``nodes`` when ``inputs`` are sliced along ``dim``; raises Invalid."""
    seeds, extent = _seeds(inputs, dim)
    if extent < 2:
        raise Invalid(f"dim {dim} has {extent} element; nothing to slice")
    decided: dict[torch.fx.Node, State] = {}
    for _ in range(len(inputs) + 1):
        propagation = _Propagation(nodes, {**seeds, **decided}, extent)
        try:
            propagation.run()
        except _Restart:
            decided.update(propagation.decided)
            continue
        final = {arg: FULL if isinstance(state, Pending) else state for arg, state in {**seeds, **decided}.items()}
        done = _Propagation(nodes, final, extent)
        done.run()  # with every input decided: no pending state, no demand
        return Proof(extent, done.states, done.rewrites)  # the inputs' states and every node's
    raise Invalid("the region's inputs could not be decided")  # pragma: no cover - bounded by the inputs
