"""Resolving a user's ``backend=`` argument: which backends to place on and which device to plan for."""

from __future__ import annotations

from typing import Any

import torch

from tightfit._validate import check_type
from tightfit.backends import registry
from tightfit.backends.base import Backend

__all__ = ["resolve_backend"]


def resolve_backend(backend: Any) -> tuple[list[Backend], torch.device]:
    """The backends to place on (highest priority first) and the device the model is planned on."""
    if backend is None:
        chosen = registry.default()
        others = [b for b in registry.available() if b is not chosen]
        return [chosen, *others], chosen.resolve_device(None)
    if isinstance(backend, Backend):
        if not backend.is_available():
            raise RuntimeError(f"backend {backend.name} is not available on this machine")
        return [backend], backend.resolve_device(None)
    check_type("backend", backend, (str, torch.device, Backend, type(None)))
    found = registry.get(backend)
    named_device = isinstance(backend, torch.device) or ":" in backend
    device = found.resolve_device(backend if named_device else None)
    return [found], torch.device("cpu") if device.type == "cpu" else device  # tensors say "cpu", never "cpu:0"
