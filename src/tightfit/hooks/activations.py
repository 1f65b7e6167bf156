"""What a module keeps for its backward: its activations kept (torch's default), recomputed
in the backward (activation checkpointing), or offloaded to host memory until the backward.

One hook on the registry (order 8: inside a region hint, around offloading's onload and
layerwise casting's upcast, so a recomputed forward onloads and upcasts again). Recompute
is ``torch.utils.checkpoint`` (non-reentrant: keyword inputs, nested hooks and
``torch.compile`` work); offload is ``torch.autograd.graph.save_on_cpu``, page-locked
where the device copies asynchronously. A training fit (:func:`tightfit.fit` with
``training=True``) chooses them per layer; they are public for a plan of one's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tightfit._validate import check_choice, check_type
from tightfit.hooks.registry import HookRegistry, ModuleHook

__all__ = [
    "ACTIVATIONS",
    "ACTIVATION_POLICIES",
    "ActivationHook",
    "activation_policies",
    "apply_activation_policy",
    "remove_activation_policy",
]

#: Name of the hook in a module's :class:`~tightfit.hooks.HookRegistry`.
ACTIVATIONS = "tightfit.activations"
#: What a module may do with the activations its backward reads.
ACTIVATION_POLICIES = ("keep", "recompute", "offload")


class ActivationHook(ModuleHook):
    """Runs the module's forward (and the hooks inside this one) recomputed in the backward
    (``"recompute"``) or with its saved tensors in host memory (``"offload"``)."""

    order = 8

    def __init__(self, policy: str, pin_memory: bool = False) -> None:
        self.policy = policy
        self.pin_memory = pin_memory

    def __repr__(self) -> str:
        return f"ActivationHook({self.policy!r})"

    def around(self, module: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved for a backward: run as it is
            return call(*args, **kwargs)
        if self.policy == "recompute":
            return checkpoint(call, *args, use_reentrant=False, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory):
            return call(*args, **kwargs)


def apply_activation_policy(model: nn.Module, policies: Mapping[str, str], *, planning: bool = False) -> None:
    """Give each module that ``policies`` names (qualified names in ``model``; ``""`` is
    ``model``) its policy: ``"keep"`` (the hook is removed), ``"recompute"`` or ``"offload"``.

    Offload moves the saved tensors to host memory, so it is refused for modules on the CPU,
    whose memory is the host's, unless ``planning``: the model is simulated for another
    device than it sits on (a module on meta may take it too). Every name and policy is
    checked before any module changes."""
    check_type("model", model, nn.Module)
    check_type("policies", policies, Mapping)
    check_type("planning", planning, bool)
    modules = dict(model.named_modules())
    chosen = []
    for name, policy in policies.items():
        check_type("policies key", name, str)
        if name not in modules:
            raise ValueError(f"policies names {name!r}, which is not a module of {type(model).__name__}")
        check_choice(f"policies[{name!r}]", policy, ACTIVATION_POLICIES)
        device = _device_of(modules[name])
        if policy == "offload" and device is not None and device.type == "cpu" and not planning:
            raise ValueError(
                f"policies[{name!r}]='offload' moves saved activations to host memory, but {name or 'the model'} is "
                f"on the CPU, whose memory that is; offload is for modules on an accelerator"
            )
        chosen.append((modules[name], policy, device))
    for module, policy, device in chosen:
        registry = HookRegistry.get(module)
        if registry is not None and ACTIVATIONS in registry:
            registry.remove(ACTIVATIONS)
        if policy != "keep":
            pin = policy == "offload" and not planning and device is not None and _copies_asynchronously(device)
            HookRegistry.of(module).register(ACTIVATIONS, ActivationHook(policy, pin_memory=pin))


def activation_policies(model: nn.Module) -> dict[str, str]:
    """The modules of ``model`` with a policy other than keep, and their policy."""
    check_type("model", model, nn.Module)
    found = {}
    for name, module in model.named_modules():
        registry = HookRegistry.get(module)
        if registry is not None and ACTIVATIONS in registry:
            found[name] = registry.hook(ACTIVATIONS).policy
    return found


def remove_activation_policy(model: nn.Module) -> list[str]:
    """Remove every activation hook under ``model``; returns the names it was removed from."""
    check_type("model", model, nn.Module)
    names = list(activation_policies(model))
    modules = dict(model.named_modules())
    for name in names:
        HookRegistry.of(modules[name]).remove(ACTIVATIONS)
    return names


def _device_of(module: nn.Module) -> torch.device | None:
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(module.buffers()), None)
    return None if tensor is None else tensor.device


def _copies_asynchronously(device: torch.device) -> bool:
    from tightfit.backends.registry import copy_streams

    return device.type != "meta" and copy_streams(device) is not None
