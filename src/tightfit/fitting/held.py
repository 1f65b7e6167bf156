"""What a model holds in a device's memory between forwards, as the planner counts it."""

from __future__ import annotations

import torch
from torch import nn

from tightfit._validate import check_device, check_type
from tightfit.hooks import resident_bytes
from tightfit.quant import QuantState

__all__ = ["held_bytes"]


def held_bytes(model: nn.Module, device: str | torch.device) -> int:
    """Bytes of ``model``'s weights in ``device``'s memory: parameters and buffers there
    (:func:`tightfit.hooks.resident_bytes`: memory-mapped offloaded files do not count)
    plus the scales and maps of quantized layers (a QuantState is neither, and offloading
    leaves it on the device)."""
    check_type("model", model, nn.Module)
    target = check_device("device", device)
    storages = {}
    for module in model.modules():
        state = getattr(module, "quant_state", None)
        if isinstance(state, QuantState):
            for tensor in state.tensors():
                if tensor.device.type == target.type:
                    storages[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
    return resident_bytes(model, target) + sum(storages.values())
