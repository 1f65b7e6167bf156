"""Finding a model's stack of repeated layers, so that a rule such as "keep the later
half of the layers in 8 bits" applies to any architecture without knowing its names."""

from __future__ import annotations

from torch import nn

from tightfit._validate import check_type

__all__ = ["layer_stack"]


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def layer_stack(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of the model's main stack of repeated layers, in order.

    The stack is the ``nn.ModuleList`` of two or more children of one type that holds the
    most ``nn.Linear`` weights: ``encoder.layer.0`` .. ``encoder.layer.5`` for a 6-layer
    BERT, ``h.0`` .. for GPT-2, ``model.layers.0`` .. for Llama. Empty when the model
    has no such list.
    """
    check_type("model", model, nn.Module)
    stack: tuple[str, ...] = ()
    most = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(child) for child in module}) != 1:
            continue
        weights = _linear_weights(module)
        if weights > most:
            prefix = f"{name}." if name else ""
            stack, most = tuple(f"{prefix}{index}" for index in range(len(module))), weights
    return stack
