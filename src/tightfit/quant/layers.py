"""Finding a model's stack of repeated layers, so that a rule such as "keep the later
half of the layers in 8 bits" applies to any architecture without knowing its names."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tightfit._validate import check_type

__all__ = ["layer_stack"]


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def largest_repeated_list(model: nn.Module, weigh: Callable[[nn.Module], int]) -> tuple[str, ...]:
    """Qualified names of the children of the ``nn.ModuleList`` of two or more children of
    one type that ``weigh`` finds heaviest (the first of equals, none weighing 0), in order.

    Internal to tightfit (not in ``__all__``): :func:`layer_stack` weighs ``nn.Linear``
    weights; the fit planner weighs bytes, for stacks without ``nn.Linear`` (GPT-2's Conv1D).
    """
    stack: tuple[str, ...] = ()
    most = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(child) for child in module}) != 1:
            continue
        weight = weigh(module)
        if weight > most:
            prefix = f"{name}." if name else ""
            stack, most = tuple(f"{prefix}{index}" for index in range(len(module))), weight
    return stack


def layer_stack(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of the model's main stack of repeated layers, in order.

    The stack is the ``nn.ModuleList`` of two or more children of one type that holds the
    most ``nn.Linear`` weights: ``encoder.layer.0`` .. ``encoder.layer.5`` for a 6-layer
    BERT, ``h.0`` .. for GPT-2, ``model.layers.0`` .. for Llama. Empty when the model
    has no such list.
    """
    check_type("model", model, nn.Module)
    return largest_repeated_list(model, _linear_weights)
