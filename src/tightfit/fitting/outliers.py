"""How much of LLM.int8()'s full-precision path the example inputs take.

An int8 layer multiplies in int8 except the input columns holding a value with
|x| >= threshold (6 by default), which it adds back in the activation's dtype: a second
output, those columns' weights dequantized and the inputs' columns. Whether that path
runs depends on the data, not the shapes, so the fake-tensor trace cannot tell: when the
model holds real weights, one real forward of the unchanged model (in eval mode, under
``torch.inference_mode``) counts the columns; otherwise (a ``meta`` skeleton, model and inputs on different devices) the planner
assumes a bound (:data:`ASSUMED_OUTLIER_FRACTION`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["ASSUMED_OUTLIER_FRACTION", "assumed_outliers", "observe_outliers"]

#: Without an observation, the share of a layer's input columns assumed to hold outliers
#: (at least one column): LLM.int8()'s outlier features are a handful of hidden dimensions.
ASSUMED_OUTLIER_FRACTION = 1 / 32


def assumed_outliers(in_features: int) -> int:
    """Outlier columns assumed for a layer with ``in_features`` inputs when none were observed."""
    return max(1, int(in_features * ASSUMED_OUTLIER_FRACTION))


def _devices(model: nn.Module, args: tuple, kwargs: dict) -> set[torch.device]:
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]
    return {tensor.device for tensor in tensors}


def observe_outliers(model: nn.Module, args: tuple, kwargs: dict, threshold: float) -> dict[str, int] | None:
    """Per ``nn.Linear`` of ``model`` (qualified name), the most input columns holding a value
    with magnitude >= ``threshold`` in any of its calls during one real forward of
    ``model(*args, **kwargs)`` under ``torch.inference_mode``; layers not called are absent.

    The forward runs in eval mode, as the planned inference does: a model in training
    mode would otherwise update its BatchNorm running statistics and count the columns
    of randomly dropped-out inputs. Every module's ``training`` flag is restored
    afterwards, also when the forward raises; the model's parameters and buffers are
    left as they were.

    None when that forward cannot run as it is: a tensor on the ``meta`` device, or the
    model's tensors and the inputs on more than one device. The forward costs one run of
    the unchanged model (its activations, no copy of the weights); it raises what the
    forward raises (running out of memory included: the planner catches that).
    """
    devices = _devices(model, args, kwargs)
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return None
    found: dict[str, int] = {}
    handles = []

    def count(name: str, module: nn.Linear, inputs: tuple) -> None:
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if x is None or not x.is_floating_point():
            return
        columns = int((x.reshape(-1, module.in_features).abs() >= threshold).any(dim=0).sum())
        found[name] = max(found.get(name, 0), columns)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda m, inputs, name=name: count(name, m, inputs)))
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.inference_mode():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    return found
