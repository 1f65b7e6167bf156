"""Tracing a model with fake tensors into the aten graphs the compile backend would get.

No real byte of a weight or an activation is allocated: the weights, buffers and inputs
are replaced by fake tensors of the same shapes, strides and dtypes on the planned
device (a model built on the ``meta`` device or under ``FakeTensorMode`` works, so one
larger than the machine can be planned), and aot_autograd traces the forward (and,
for training, the backward) exactly as ``torch.compile(model, backend="tightfit")``
does after dynamo.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Traced", "refuse_data_dependence", "trace"]


@dataclass
class Traced:
    """The traced graphs: ("inference", gm) or ("forward", gm) then ("backward", gm).

    ``weights``: how many leading placeholders of the first graph are parameters and
    buffers of the model; ``saved``: the forward's outputs that the backward reads,
    as (forward output position, backward placeholder position) pairs; ``losses``: the
    forward's output positions of the outputs the backward starts from (kept to the end
    of a training step; the other outputs are dropped when the forward returns).
    """

    graphs: list[tuple[str, torch.fx.GraphModule]]
    weights: int
    saved: list[tuple[int, int]]
    device: torch.device
    losses: list[int] = field(default_factory=list)


def _fake(mode: Any, tensor: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(f"memory planning supports strided tensors only, got layout {tensor.layout}")
    with mode:
        fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=device)
    if requires_grad:
        fake.requires_grad_(True)
    return fake


def _check_inputs(example_inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for index, leaf in enumerate(tree_flatten((list(example_inputs), dict(kwargs)))[0]):
        if isinstance(leaf, torch.Tensor) and (leaf.is_sparse or leaf.layout != torch.strided):
            raise ValueError(
                f"example input {index} is a {leaf.layout} tensor; memory planning supports strided tensors only"
            )


def _returned_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor the caller gets back: pytree leaves, and the tensors held in the attributes
    of other objects among them (a transformers cache): what dynamo returns from the graph
    and the caller keeps alive. Modules are not followed (their weights are no output)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    pending = [out]
    while pending:
        value = pending.pop()
        for leaf in tree_flatten(value)[0]:
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif (
                hasattr(leaf, "__dict__")
                and id(leaf) not in seen
                and not isinstance(leaf, (type, torch.nn.Module))
                and not callable(leaf)
            ):
                seen.add(id(leaf))
                pending.append(list(vars(leaf).values()))
    return found


@dataclass
class _Flat:
    """The model as a function of flat tensors: weights first, then the example inputs' tensors."""

    model: torch.nn.Module
    names: list[str]
    leaves: list[Any]
    spec: Any
    positions: list[int]
    state: list[torch.Tensor]
    fakes: list[torch.Tensor]

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """The model holds the fake weights for the whole block, not only during a call: a
        backward that recomputes a checkpointed forward (activation checkpointing) runs the
        module's code again after the call has returned. (torch's own ``functional_call``
        swaps the same way, through this helper.)"""
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(self.model, dict(zip(self.names, self.state)), tie_weights=True):
            yield

    def __call__(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from torch.func import functional_call

        weights = dict(zip(self.names, flat[: len(self.names)]))
        filled = list(self.leaves)
        for position, value in zip(self.positions, flat[len(self.names) :]):
            filled[position] = value
        args, kwargs = tree_unflatten(filled, self.spec)
        out = functional_call(self.model, weights, tuple(args), kwargs)
        outs = tuple(_returned_tensors(out))
        if not outs:
            raise ValueError(f"{type(self.model).__name__} returned no tensor; there is nothing to plan")
        return outs


def _flatten(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    mode: Any,
    device: torch.device,
    training: bool,
) -> _Flat:
    _check_inputs(example_inputs, kwargs)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    state = [_fake(mode, t, device, training and t.requires_grad) for t in params.values()]
    state += [_fake(mode, t, device, False) for t in buffers.values()]
    leaves, spec = tree_flatten((list(example_inputs), dict(kwargs)))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    fakes = [_fake(mode, leaves[i], device, training and leaves[i].requires_grad) for i in positions]
    return _Flat(model, list(params) + list(buffers), leaves, spec, positions, state, fakes)


def trace(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    device: torch.device,
    training: bool,
) -> Traced:
    """Trace ``model(*example_inputs, **kwargs)`` with fake tensors on ``device``, as aot_autograd does."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    flat = _flatten(model, example_inputs, kwargs, mode, device, training)
    graphs: dict[str, torch.fx.GraphModule] = {}

    def capture(stage: str):
        def compiler(graph_module: torch.fx.GraphModule, _examples: Any) -> Any:
            graphs[stage] = graph_module
            return make_boxed_func(graph_module.forward)

        return compiler

    compiled = aot_function(
        flat, fw_compiler=capture("forward"), bw_compiler=capture("backward"), inference_compiler=capture("inference")
    )
    with _compile_session(), fx_traceback.preserve_node_meta(), mode:  # hints reach the nodes, as under dynamo
        outs = compiled(*flat.state, *flat.fakes)
        if training:
            chosen = _backward(outs, type(model).__name__)
    if training:
        saved = _saved(graphs["forward"], graphs["backward"])
        returned = len(next(node for node in graphs["forward"].graph.nodes if node.op == "output").args[0])
        first_user = returned - len(saved) - len(outs)  # aot_autograd returns mutated inputs first
        return Traced(
            [("forward", graphs["forward"]), ("backward", graphs["backward"])],
            len(flat.names),
            saved,
            device,
            [first_user + index for index in chosen],
        )
    return Traced([("inference", graphs["inference"])], len(flat.names), [], device)


def _compile_session() -> Any:
    """``torch.compiler.is_compiling()`` is True while tracing, as under ``torch.compile``.

    Model code checks it to skip data-dependent work that fake tensors cannot do
    (transformers' mask preparation does).
    """
    session = getattr(torch.compiler, "_compile_session_context", None)
    return session() if session is not None else contextlib.nullcontext()


def _loss_outputs(outs: Sequence[torch.Tensor], model_name: str) -> list[torch.Tensor]:
    """The scalar outputs that need a gradient (a loss), else every output that does."""
    needing = [out for out in outs if out.requires_grad and out.dtype.is_floating_point]
    if not needing:
        raise ValueError(
            f"training=True, but no output of {model_name} needs a gradient (no parameter or input requires grad)"
        )
    losses = [out for out in needing if out.dim() == 0]
    return losses or needing


def _backward(outs: Sequence[torch.Tensor], model_name: str) -> list[int]:
    """Backward from the loss outputs, as a training step does; their positions in ``outs``."""
    chosen = _loss_outputs(outs, model_name)
    torch.autograd.backward(chosen, [torch.ones_like(out) for out in chosen])
    return [index for index, out in enumerate(outs) if any(out is loss for loss in chosen)]


def _saved(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """(forward output position, backward placeholder position) of each saved value."""
    out_node = next(node for node in forward.graph.nodes if node.op == "output")
    outputs = list(out_node.args[0])
    placeholders = [node for node in backward.graph.nodes if node.op == "placeholder"]
    saved = [node for node in placeholders if not node.name.startswith("tangents")]
    first = len(outputs) - len(saved)
    pairs = []
    for index, node in enumerate(saved):
        pairs.append((first + index, placeholders.index(node)))
    return pairs


@contextlib.contextmanager
def refuse_data_dependence(model: torch.nn.Module) -> Iterator[None]:
    """Turn torch's bare exception for a forward that depends on tensor values into a ValueError
    saying so, where in the model's code, and what to do: a plan runs on fake tensors, which have
    shapes and dtypes but no values."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (
        (DataDependentOutputException, "reads a tensor's value into Python (`if tensor`, `.item()`, `int(tensor)`)"),
        (DynamicOutputShapeException, "makes a tensor whose shape depends on values (`nonzero`, `x[mask]`, `unique`)"),
        (GuardOnDataDependentSymNode, "branches on a value computed from tensor data"),
    )
    try:
        yield
    except tuple(kind for kind, _ in kinds) as error:
        what = next(text for kind, text in kinds if isinstance(error, kind))
        library = (
            os.path.dirname(os.path.abspath(torch.__file__)),
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        frames = [
            frame
            for frame in traceback.extract_tb(error.__traceback__)
            if not frame.filename.startswith((*library, "<"))
        ]
        where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
        detail = " ".join(str(error).split()[:12])
        raise ValueError(
            f"{type(model).__name__}'s forward {what}{where}: a plan runs the model on fake tensors, which have shapes but "
            f"no values, so it cannot follow that (torch: {type(error).__name__}: {detail}). Make the forward independent "
            "of tensor values (torch.where instead of a Python branch, a Python argument instead of a tensor flag), or "
            "measure real calls with tightfit.memory.measure instead of planning"
        ) from error
