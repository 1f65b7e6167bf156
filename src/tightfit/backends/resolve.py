"""Resolving a user's ``backend=`` argument: which backends to place on and which device to plan for."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tightfit._validate import check_type
from tightfit.backends import registry
from tightfit.backends.base import Backend

__all__ = ["ResolvedBackend", "resolve_backend"]


class ResolvedBackend(NamedTuple):
    """What :func:`resolve_backend` gives: the backends to place on (highest priority
    first) and the device. A caller holding one passes it on as ``backend=``, and it is
    not resolved again: a run resolves its backend once."""

    backends: list[Backend]
    device: torch.device


def resolve_backend(backend: Any) -> ResolvedBackend:
    """The backends to place on (highest priority first) and the device the model is
    planned on; a :class:`ResolvedBackend` is taken as it is."""
    if isinstance(backend, ResolvedBackend):
        return backend
    backends, device = _resolve(backend)
    return ResolvedBackend(backends, device)


def _resolve(backend: Any) -> tuple[list[Backend], torch.device]:
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
