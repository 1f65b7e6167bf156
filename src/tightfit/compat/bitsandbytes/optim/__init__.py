"""``bitsandbytes.optim`` on tightfit's optimizers (:mod:`tightfit.optim`): bitsandbytes'
class names, signatures and state dicts, and its :class:`GlobalOptimManager` per-parameter
overrides. Every step runs tightfit's optimizer ops on the parameter's device.

Where bitsandbytes silently ignores an argument (RMSprop's ``momentum``, SGD's
``dampening`` and ``nesterov``), these refuse a value that would change the update, naming
it (docs/migrating.md). ``is_paged`` and the ``Paged*`` classes page the state through host
memory on every device (bitsandbytes needs managed memory, and falls back to resident
state on the CPU with a warning: here host-resident state is simply where it already is).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch

from tightfit import optim
from tightfit._validate import check_type

__all__ = [
    "SGD",
    "AdEMAMix",
    "AdEMAMix8bit",
    "AdEMAMix32bit",
    "Adagrad",
    "Adagrad8bit",
    "Adagrad32bit",
    "Adam",
    "Adam8bit",
    "Adam32bit",
    "AdamW",
    "AdamW8bit",
    "AdamW32bit",
    "GlobalOptimManager",
    "LAMB",
    "LAMB8bit",
    "LAMB32bit",
    "LARS",
    "LARS8bit",
    "LARS32bit",
    "PytorchLARS",
    "Lion",
    "Lion8bit",
    "Lion32bit",
    "PagedAdEMAMix",
    "PagedAdEMAMix8bit",
    "PagedAdEMAMix32bit",
    "PagedAdam",
    "PagedAdam8bit",
    "PagedAdam32bit",
    "PagedAdamW",
    "PagedAdamW8bit",
    "PagedAdamW32bit",
    "PagedLion",
    "PagedLion8bit",
    "PagedLion32bit",
    "RMSprop",
    "RMSprop8bit",
    "RMSprop32bit",
    "SGD8bit",
    "SGD32bit",
]


class GlobalOptimManager:
    """Per-parameter settings over an optimizer's groups, as bitsandbytes' manager keeps
    them: ``override_config(p, "optim_bits", 32)`` before the first step (a parameter is
    known by its identity, registered while on the CPU or after)."""

    _instance: GlobalOptimManager | None = None

    def __init__(self) -> None:
        raise RuntimeError("Call get_instance() instead")

    def initialize(self) -> None:
        self.pid2config: dict[int, dict[str, Any]] = {}
        self.index2config: dict[tuple[int, int], dict[str, Any]] = {}
        self.optimizer = None
        self.uses_config_override = False
        self.module_weight_config_triple: list[tuple[torch.nn.Module, str, dict[str, Any]]] = []

    @classmethod
    def get_instance(cls) -> GlobalOptimManager:
        if cls._instance is None:
            cls._instance = cls.__new__(cls)
            cls._instance.initialize()
        return cls._instance

    def register_parameters(self, params: Iterable[Any]) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for gindex, group in enumerate(groups):
            for pindex, p in enumerate(group["params"]):
                if id(p) in self.pid2config:
                    self.index2config[(gindex, pindex)] = self.pid2config[id(p)]

    def override_config(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        key: str | None = None,
        value: Any = None,
        key_value_dict: dict[str, Any] | None = None,
    ) -> None:
        """Settings for ``parameters``: ``key`` and ``value``, or several in ``key_value_dict``."""
        self.uses_config_override = True
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if key is not None and value is not None:
            if key_value_dict is not None:
                raise ValueError("give key and value, or key_value_dict, not both")
            key_value_dict = {key: value}
        if key_value_dict is None:
            return
        check_type("key_value_dict", key_value_dict, dict)
        for p in parameters:
            check_type("parameters", p, torch.Tensor)
            self.pid2config.setdefault(id(p), {}).update(key_value_dict)

    def register_module_override(self, module: torch.nn.Module, param_name: str, config: dict[str, Any]) -> None:
        self.module_weight_config_triple.append((module, param_name, config))


class _Managed:
    """The manager's overrides applied to each parameter's settings; ``args``, the settings
    object bitsandbytes' optimizers keep. ``_bits`` and ``_paged``: a width and paging fixed
    by the class (``Adam8bit``, ``PagedAdamW``: :func:`_variant`); else the arguments'."""

    _bits: int | None = None
    _paged = False

    @property
    def args(self) -> SimpleNamespace:
        return SimpleNamespace(
            optim_bits=self.defaults["optim_bits"],
            min_8bit_size=self.defaults["min_8bit_size"],
            max_unorm=self.defaults.get("max_unorm", 0.0),
            skip_zeros=False,
        )

    def config(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> dict[str, Any]:
        manager = GlobalOptimManager.get_instance()
        if not getattr(self, "_modules_checked", False):
            self._modules_checked = True
            for module, name, settings in manager.module_weight_config_triple:
                target = getattr(module, name)
                if any(q is target for g in self.param_groups for q in g["params"]):
                    manager.pid2config[id(target)] = settings
        overrides = {**manager.index2config.get((gindex, pindex), {}), **manager.pid2config.get(id(p), {})}
        if not overrides:
            return group
        merged = {**group, **overrides}
        optim.optimizer.check_group(merged, self.rule)
        return merged


def _settings(args: Any, optim_bits: int, min_8bit_size: int) -> tuple[int, int]:
    """(optim_bits, min_8bit_size), from bitsandbytes' ``args`` object where one is given."""
    if args is None:
        return optim_bits, min_8bit_size
    return getattr(args, "optim_bits", optim_bits), getattr(args, "min_8bit_size", min_8bit_size)


def _refuse(name: str, value: Any, accepted: Any, why: str) -> None:
    if value != accepted:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: {accepted!r} ({why})")


def _check_momentum(name: str, momentum: Any, dampening: Any, nesterov: Any) -> None:
    """SGD's and LARS's momentum arguments as bitsandbytes takes them: a momentum (without
    one bitsandbytes raises NotImplementedError), and no dampening or Nesterov, which its
    update ignores."""
    if momentum == 0:
        raise NotImplementedError(f"{name} without momentum is not supported!")
    _refuse("dampening", dampening, 0, "bitsandbytes' update ignores it; a value would not be honored")
    _refuse("nesterov", nesterov, False, "bitsandbytes' update ignores it; a value would not be honored")


class Adam(_Managed, optim.Adam):
    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        is_paged=False,
    ):
        _refuse("amsgrad", amsgrad, False, "bitsandbytes' optimizers have no AMSGrad either")
        bits, size = _settings(args, optim_bits, min_8bit_size)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            optim_bits=self._bits or bits,
            min_8bit_size=size,
            paged=self._paged or is_paged,
        )


class AdamW(Adam):
    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        is_paged=False,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, optim_bits, args, min_8bit_size, is_paged)


class AdEMAMix(_Managed, optim.AdEMAMix):
    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999, 0.9999),
        alpha=5.0,
        t_alpha=None,
        t_beta3=None,
        eps=1e-8,
        weight_decay=1e-2,
        optim_bits=32,
        min_8bit_size=4096,
        is_paged=False,
    ):
        super().__init__(
            params,
            lr,
            betas,
            alpha,
            t_alpha,
            t_beta3,
            eps,
            weight_decay,
            optim_bits=self._bits or optim_bits,
            min_8bit_size=min_8bit_size,
            paged=self._paged or is_paged,
        )


class Lion(_Managed, optim.Lion):
    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        is_paged=False,
    ):
        bits, size = _settings(args, optim_bits, min_8bit_size)
        super().__init__(
            params,
            lr,
            betas,
            weight_decay,
            optim_bits=self._bits or bits,
            min_8bit_size=size,
            paged=self._paged or is_paged,
        )


class SGD(_Managed, optim.SGD):
    def __init__(
        self,
        params,
        lr,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
    ):
        _check_momentum("SGD", momentum, dampening, nesterov)
        bits, size = _settings(args, optim_bits, min_8bit_size)
        super().__init__(params, lr, momentum, weight_decay, optim_bits=self._bits or bits, min_8bit_size=size)


class RMSprop(_Managed, optim.RMSprop):
    def __init__(
        self,
        params,
        lr=1e-2,
        alpha=0.99,
        eps=1e-8,
        weight_decay=0,
        momentum=0,
        centered=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
    ):
        if alpha == 0:
            raise NotImplementedError("RMSprop with alpha==0.0 is not supported!")
        if centered:
            raise NotImplementedError("Centered RMSprop is not supported!")
        _refuse("momentum", momentum, 0, "bitsandbytes' update ignores it; a value would not be honored")
        bits, size = _settings(args, optim_bits, min_8bit_size)
        super().__init__(params, lr, alpha, eps, weight_decay, optim_bits=self._bits or bits, min_8bit_size=size)


class Adagrad(_Managed, optim.Adagrad):
    def __init__(
        self,
        params,
        lr=1e-2,
        lr_decay=0,
        weight_decay=0,
        initial_accumulator_value=0,
        eps=1e-10,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
    ):
        if initial_accumulator_value != 0.0:
            raise ValueError("Initial accumulator value != 0.0 not supported!")
        if lr_decay != 0.0:
            raise ValueError("Lr Decay != 0.0 not supported!")
        bits, size = _settings(args, optim_bits, min_8bit_size)
        super().__init__(params, lr, eps, weight_decay, optim_bits=self._bits or bits, min_8bit_size=size)


class LAMB(_Managed, optim.LAMB):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adam_w_mode=True,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        max_unorm=1.0,
    ):
        _refuse("amsgrad", amsgrad, False, "bitsandbytes' optimizers have no AMSGrad either")
        _refuse("bias_correction", bias_correction, True, "bitsandbytes' update always corrects the bias")
        _refuse("adam_w_mode", adam_w_mode, True, "bitsandbytes' update always decays as AdamW does")
        if self._bits == 8 and max_unorm != 1.0:
            raise ValueError("LAMB8bit only supports max_unorm=1.0: the 8-bit blockwise update bounds no norm")
        bits, size = _settings(args, optim_bits, min_8bit_size)
        super().__init__(
            params, lr, betas, eps, weight_decay, max_unorm, optim_bits=self._bits or bits, min_8bit_size=size
        )


class LARS(_Managed, optim.LARS):
    def __init__(
        self,
        params,
        lr,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        max_unorm=0.02,
    ):
        _check_momentum("LARS", momentum, dampening, nesterov)
        bits, size = _settings(args, optim_bits, min_8bit_size)
        super().__init__(
            params, lr, momentum, weight_decay, max_unorm, optim_bits=self._bits or bits, min_8bit_size=size
        )


class PytorchLARS(torch.optim.Optimizer):
    """LARS in torch operations (bitsandbytes' reference for its LARS): SGD with momentum,
    dampening and Nesterov's variant, each update's norm bounded by ``max_unorm`` times the
    parameter's."""

    def __init__(self, params, lr=0.01, momentum=0, dampening=0, weight_decay=0, nesterov=False, max_unorm=0.02):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            max_unorm=max_unorm,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                if group["momentum"]:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = direction.clone()
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(direction, alpha=1 - group["dampening"])
                    buffer = state["momentum_buffer"]
                    direction = direction + buffer * group["momentum"] if group["nesterov"] else buffer
                scale = 1.0
                if group["max_unorm"] > 0:
                    norm, bound = torch.norm(direction), group["max_unorm"] * torch.norm(p)
                    if norm > bound:
                        scale = bound / norm
                p.add_(direction * scale, alpha=-group["lr"])
        return loss


def _variant(base: type, name: str, bits: int | None, paged: bool, drop: tuple[str, ...] = ()) -> type:
    """bitsandbytes' fixed-width and paged classes: ``base`` with its width or paging set,
    and bitsandbytes' signature for it (``base``'s without ``drop``; ``optim_bits``
    defaulting to the width where it stays)."""
    signature = inspect.signature(base.__init__)
    parameters = [
        p.replace(default=bits) if p.name == "optim_bits" and bits and base is Adagrad else p
        for p in signature.parameters.values()
        if p.name not in drop
    ]
    fixed = signature.replace(parameters=parameters)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = fixed.bind(self, *args, **kwargs)
        bound.apply_defaults()
        base.__init__(**bound.arguments)

    __init__.__signature__ = fixed  # type: ignore[attr-defined]
    namespace = {"_bits": bits, "_paged": paged, "__module__": __name__, "__doc__": base.__doc__, "__init__": __init__}
    return type(name, (base,), namespace)


_WIDTH, _PAGING = ("optim_bits",), ("is_paged",)
Adam8bit, Adam32bit = _variant(Adam, "Adam8bit", 8, False), _variant(Adam, "Adam32bit", 32, False)
PagedAdam = _variant(Adam, "PagedAdam", None, True)
PagedAdam8bit, PagedAdam32bit = _variant(Adam, "PagedAdam8bit", 8, True), _variant(Adam, "PagedAdam32bit", 32, True)
AdamW8bit, AdamW32bit = _variant(AdamW, "AdamW8bit", 8, False), _variant(AdamW, "AdamW32bit", 32, False)
PagedAdamW = _variant(AdamW, "PagedAdamW", None, True, _PAGING)
PagedAdamW8bit = _variant(AdamW, "PagedAdamW8bit", 8, True, _PAGING)
PagedAdamW32bit = _variant(AdamW, "PagedAdamW32bit", 32, True, _PAGING)
AdEMAMix8bit = _variant(AdEMAMix, "AdEMAMix8bit", 8, False, _WIDTH)
AdEMAMix32bit = _variant(AdEMAMix, "AdEMAMix32bit", 32, False, _WIDTH)
PagedAdEMAMix = _variant(AdEMAMix, "PagedAdEMAMix", None, True, _PAGING)
PagedAdEMAMix8bit = _variant(AdEMAMix, "PagedAdEMAMix8bit", 8, True, _WIDTH + _PAGING)
PagedAdEMAMix32bit = _variant(AdEMAMix, "PagedAdEMAMix32bit", 32, True, _WIDTH + _PAGING)
Lion8bit, Lion32bit = _variant(Lion, "Lion8bit", 8, False, _WIDTH), _variant(Lion, "Lion32bit", 32, False, _WIDTH)
PagedLion = _variant(Lion, "PagedLion", None, True, _PAGING)
PagedLion8bit = _variant(Lion, "PagedLion8bit", 8, True, _WIDTH + _PAGING)
PagedLion32bit = _variant(Lion, "PagedLion32bit", 32, True, _WIDTH + _PAGING)
SGD8bit, SGD32bit = _variant(SGD, "SGD8bit", 8, False, _WIDTH), _variant(SGD, "SGD32bit", 32, False, _WIDTH)
RMSprop8bit = _variant(RMSprop, "RMSprop8bit", 8, False, _WIDTH)
RMSprop32bit = _variant(RMSprop, "RMSprop32bit", 32, False, _WIDTH)
Adagrad8bit, Adagrad32bit = _variant(Adagrad, "Adagrad8bit", 8, False), _variant(Adagrad, "Adagrad32bit", 32, False)


from tightfit.compat.bitsandbytes.optim import ademamix  # noqa: E402, F401 (the submodule; it imports the classes above)

LAMB8bit, LAMB32bit = _variant(LAMB, "LAMB8bit", 8, False, _WIDTH), _variant(LAMB, "LAMB32bit", 32, False, _WIDTH)
LARS8bit, LARS32bit = _variant(LARS, "LARS8bit", 8, False, _WIDTH), _variant(LARS, "LARS32bit", 32, False, _WIDTH)
