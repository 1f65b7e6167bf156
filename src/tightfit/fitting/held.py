"""What a model holds in a device's memory between forwards, as the planner counts it."""

from __future__ import annotations

import torch
from torch import nn

from tightfit._validate import check_device, check_type
from tightfit.hooks import resident_bytes
from tightfit.memory import tensor_bytes
from tightfit.quant import unregistered_tensors

__all__ = ["held_bytes"]


def held_bytes(model: nn.Module, device: str | torch.device) -> int:
    """Bytes of ``model``'s weights in ``device``'s memory: parameters and buffers there
    (:func:`tightfit.hooks.resident_bytes`: memory-mapped offloaded files do not count)
    plus the tensors its quantized layers hold outside those (their scales and maps,
    which offloading leaves on the device: :func:`tightfit.quant.unregistered_tensors`)."""
    check_type("model", model, nn.Module)
    target = check_device("device", device)
    return resident_bytes(model, target) + tensor_bytes(
        t for t in unregistered_tensors(model) if t.device.type == target.type
    )
