"""A hook registry for any ``nn.Module``: named hooks that run before, after and around
its ``forward``, in a defined order, removable so that the module is exactly as before.

The registry wraps the module's ``forward`` once (``functools.update_wrapper``, so
``inspect.signature`` and ``torch.export`` see the original signature) and calls every
hook from that one wrapper: hooks sort by their ``order`` (lower runs its
``pre_forward`` first and its ``post_forward`` last, and its ``around`` encloses the
others), then by when they were registered. So the nesting of tightfit's own hooks
(offloading, layerwise casting, region hints) is fixed by their orders, never by the
order in which they were applied. Removing the last hook puts the module's own
``forward`` back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from tightfit._validate import check_type
from tightfit.hooks import _diffusers

__all__ = ["HookRegistry", "ModuleHook"]

_ATTRIBUTE = "_tightfit_hooks"


class ModuleHook:
    """One hook on one module. Subclasses override what they need; every method has a no-op default.

    ``order`` places the hook among the others on the same module: lower encloses higher.
    tightfit's own hooks use 5 for region hints (the region covers the copies and casts
    of the hooks inside it), 10 for offloading (weights must be on the device first) and
    20 for layerwise casting; user hooks default to 50.
    """

    order: int = 50
    #: The name diffusers looks this kind of hook up by (``"layerwise_casting"``, ``"group_offloading"``):
    #: the registry shows the hook to diffusers under it (``hooks/_diffusers.py``); None: not shown.
    diffusers_name: str | None = None

    def attach(self, module: nn.Module) -> None:
        """Called once when the hook is registered on ``module``."""

    def detach(self, module: nn.Module) -> None:
        """Called once when the hook is removed; undo what ``attach`` did to ``module``."""

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """Runs before ``forward``; returns the (possibly changed) positional and keyword arguments."""
        return args, kwargs

    def around(self, module: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Runs what this hook encloses, ``call(*args, **kwargs)`` (the hooks of higher order,
        then ``forward``), between ``pre_forward`` and ``post_forward``; returns its output.

        Override it to run that inside something, such as a context manager (a hint
        region); the call must happen exactly once.
        """
        return call(*args, **kwargs)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Runs after ``forward``; returns the (possibly changed) output."""
        return output

    def abort(self, module: nn.Module) -> None:
        """Runs instead of ``post_forward`` when the forward, or a hook it encloses, raised: undo ``pre_forward``.

        A ``pre_forward`` or ``post_forward`` that raises gets no ``abort``: it must leave
        the module as it found it (or as ``post_forward`` would have).
        """


class HookRegistry:
    """The hooks of one module, by name. Get it with :meth:`of` (creates) or :meth:`get` (may be None)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._hooks: dict[str, ModuleHook] = {}
        self._sequence: dict[str, int] = {}
        self._counter = 0
        self._ordered: tuple[ModuleHook, ...] = ()
        self._inner_forward: Callable | None = None  # what the wrapper calls
        self._had_own_forward = False  # the instance had a ``forward`` attribute before us
        self._wrapper: Callable | None = None

    # -- lookup ------------------------------------------------------------------------
    @classmethod
    def get(cls, module: nn.Module) -> HookRegistry | None:
        """The registry of ``module``, or None when it has never had a hook."""
        return module.__dict__.get(_ATTRIBUTE)

    @classmethod
    def of(cls, module: nn.Module) -> HookRegistry:
        """The registry of ``module``, created on first use."""
        check_type("module", module, nn.Module)
        registry = cls.get(module)
        if registry is None:
            registry = cls(module)
            module.__dict__[_ATTRIBUTE] = registry  # not a submodule, not in state_dict
        return registry

    def __contains__(self, name: object) -> bool:
        return name in self._hooks

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._hooks)

    def names(self) -> list[str]:
        """Hook names in the order their ``pre_forward`` runs."""
        return sorted(self._hooks, key=self._sort_key)

    def hook(self, name: str) -> ModuleHook | None:
        """The hook registered under ``name``, or None."""
        return self._hooks.get(name)

    def __repr__(self) -> str:
        return f"HookRegistry({type(self.module).__name__}: {', '.join(self.names()) or 'no hooks'})"

    # -- changes -----------------------------------------------------------------------
    def register(self, name: str, hook: ModuleHook) -> ModuleHook:
        """Attach ``hook`` under ``name``; a name already present is an error. Returns the hook."""
        check_type("name", name, str)
        check_type("hook", hook, ModuleHook)
        if not name:
            raise ValueError("name must be a non-empty str")
        if isinstance(hook.order, bool) or not isinstance(hook.order, int):
            raise TypeError(f"hook.order must be an int, got {hook.order!r}")
        if name in self._hooks:
            raise ValueError(
                f"a hook named {name!r} is already registered on this {type(self.module).__name__}; remove it first"
            )
        hook.attach(self.module)
        self._hooks[name] = hook
        self._sequence[name] = self._counter
        self._counter += 1
        self._refresh()
        if self._wrapper is None:
            self._install()
        _diffusers.announce(self.module, hook)
        return hook

    def remove(self, name: str) -> ModuleHook:
        """Detach the hook named ``name`` and return it; the last one out restores ``forward``."""
        if name not in self._hooks:
            raise ValueError(
                f"no hook named {name!r} on this {type(self.module).__name__}; registered: {', '.join(self.names()) or 'none'}"
            )
        hook = self._hooks.pop(name)
        del self._sequence[name]
        self._refresh()
        _diffusers.withdraw(self.module, hook)
        hook.detach(self.module)
        if not self._hooks:
            self._uninstall()
        return hook

    def _sort_key(self, name: str) -> tuple[int, int]:
        return self._hooks[name].order, self._sequence[name]

    def _refresh(self) -> None:
        self._ordered = tuple(self._hooks[name] for name in self.names())

    # -- the forward wrapper -------------------------------------------------------------
    def _install(self) -> None:
        module = self.module
        self._had_own_forward = "forward" in module.__dict__
        self._inner_forward = module.forward
        wrapper = functools.update_wrapper(functools.partial(_hooked_forward, self), self._inner_forward)
        self._wrapper = wrapper
        module.__dict__["forward"] = wrapper

    def _uninstall(self) -> None:
        module = self.module
        if module.__dict__.get("forward") is not self._wrapper:
            return  # someone wrapped forward after us: keep ours, which now passes straight through
        if self._had_own_forward:
            module.__dict__["forward"] = self._inner_forward
        else:
            del module.__dict__["forward"]
        del module.__dict__[_ATTRIBUTE]
        self._wrapper = None
        self._inner_forward = None


def _hooked_forward(registry: HookRegistry, *args: Any, **kwargs: Any) -> Any:
    return _enter(registry.module, registry._ordered, 0, registry._inner_forward, *args, **kwargs)


def _enter(
    module: nn.Module,
    hooks: tuple[ModuleHook, ...],
    index: int,
    forward: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run ``hooks[index:]`` around ``forward``: each hook's ``pre_forward``, its ``around``
    (which calls the hooks inside it), then its ``post_forward``. When anything inside a
    hook raises (``forward``, an inner hook, or its own ``around``), the hook's ``abort``
    runs instead of its ``post_forward``; its own ``pre_forward`` or ``post_forward``
    raising gets no ``abort``. (Positional-only, so ``forward``'s keywords never clash.)"""
    if index == len(hooks):
        return forward(*args, **kwargs)
    hook = hooks[index]
    args, kwargs = hook.pre_forward(module, args, kwargs)
    try:
        output = hook.around(module, functools.partial(_enter, module, hooks, index + 1, forward), args, kwargs)
    except BaseException:
        hook.abort(module)
        raise
    return hook.post_forward(module, output)
