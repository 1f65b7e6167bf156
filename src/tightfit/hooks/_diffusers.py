"""tightfit's hooks as diffusers sees them. Private.

diffusers finds hooks through a registry at ``module._diffusers_hook`` and asks it for
one by name: ``get_parameter_dtype`` (so ``model.dtype``, and the 10 model files that
call it on a submodule to cast their activations) returns the ``compute_dtype`` of a
``"layerwise_casting"`` hook on any submodule, and ``_is_group_offload_enabled`` /
``get_parameter_device`` (guards in ``.to()``, ``.cuda()``, pipelines' offloading and
device choice) look for a ``"group_offloading"`` hook and read its
``config.onload_device``. Without a hook there, a float8-stored weight reads as float8.

So when a tightfit hook is applied to a module tree holding a diffusers model (its
``diffusers.hooks.hooks`` module is then loaded: every diffusers model imports it), each
hook that has a diffusers name gets a stand-in registered under that name in its
module's diffusers registry, through diffusers' own ``register_hook``. The stand-in does
nothing in the forward; tightfit never imports diffusers, and other models get none.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

from torch import nn

__all__: list[str] = []

_ATTRIBUTE = "_diffusers_hook"


class _StandIn:
    """What diffusers' registry holds for one tightfit hook: diffusers' ModelHook protocol, doing nothing.

    Attribute reads go to the tightfit hook (``compute_dtype``, ``storage_dtype``, ``config``).
    """

    _is_stateful = False

    def __init__(self, hook: Any, name: str) -> None:
        self.hook = hook
        self.name = name
        self.fn_ref = None  # diffusers sets it
        self.leaving = False

    def __getattr__(self, attribute: str) -> Any:
        if attribute == "hook" or attribute.startswith("__"):
            raise AttributeError(attribute)  # not set yet (a copy being built), or a protocol lookup
        if attribute == "config":
            return self.hook.diffusers_config()
        return getattr(self.hook, attribute)

    def __repr__(self) -> str:
        return f"tightfit {self.hook!r}"

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        return module

    def deinitalize_hook(self, module: nn.Module) -> nn.Module:  # diffusers' spelling
        if not self.leaving:
            remove = "remove_offloading" if self.name == "group_offloading" else "remove_layerwise_casting"
            raise RuntimeError(
                f"the {self.name!r} hook on this {type(module).__name__} is tightfit's; remove it with "
                f"tightfit.hooks.{remove}(model), change the model, then apply it again"
            )
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        return output

    def reset_state(self, module: nn.Module) -> nn.Module:
        return module


#: Set by :func:`within`: whether hooks applied now get stand-ins, decided for the whole model.
_WITHIN: ContextVar[bool | None] = ContextVar("tightfit_diffusers_within", default=None)


@contextmanager
def within(model: nn.Module) -> Iterator[None]:
    """Hooks applied to parts of ``model`` meanwhile (the storage catalogue casts leaf by
    leaf, each leaf its own root) get stand-ins as hooks applied to ``model`` would."""
    token = _WITHIN.set(wanted(model))
    try:
        yield
    finally:
        _WITHIN.reset(token)


def wanted(root: nn.Module) -> bool:
    """Whether hooks applied to ``root`` get stand-ins: diffusers is loaded and ``root``
    (or the model :func:`within` names) holds a diffusers module."""
    decided = _WITHIN.get()
    if decided is not None:
        return decided
    return "diffusers.hooks.hooks" in sys.modules and any(
        type(module).__module__.startswith("diffusers.") for module in root.modules()
    )


def announce(module: nn.Module, hook: Any) -> None:
    """Register a stand-in for ``hook`` in ``module``'s diffusers registry, when diffusers is loaded."""
    name = getattr(hook, "diffusers_name", None)
    hooks = sys.modules.get("diffusers.hooks.hooks")
    if name is None or hooks is None:
        return
    created = _ATTRIBUTE not in module.__dict__
    registry = hooks.HookRegistry.check_if_exists_or_initialize(module)
    if registry.get_hook(name) is not None:
        return  # diffusers' own hook of that name is there, and diffusers sees it
    stand_in = _StandIn(hook, name)
    registry.register_hook(stand_in, name)
    hook.__dict__.setdefault("_diffusers_stand_ins", {})[id(module)] = (stand_in, created)


def withdraw(module: nn.Module, hook: Any) -> None:
    """Remove ``hook``'s stand-in, and the diffusers registry when tightfit created it and it is empty now."""
    stand_in, created = hook.__dict__.get("_diffusers_stand_ins", {}).pop(id(module), (None, False))
    registry = module.__dict__.get(_ATTRIBUTE)
    if stand_in is None or registry is None or registry.get_hook(stand_in.name) is not stand_in:
        return
    stand_in.leaving = True
    registry.remove_hook(stand_in.name, recurse=False)
    if created and not registry.hooks:
        del module.__dict__[_ATTRIBUTE]


def offload_config(onload_device: Any, offload_device: Any, **options: Any) -> SimpleNamespace:
    """The fields of diffusers' ``GroupOffloadingConfig`` that its guards read."""
    return SimpleNamespace(onload_device=onload_device, offload_device=offload_device, **options)
