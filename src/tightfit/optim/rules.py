"""The optimizers, each an update rule of :class:`BlockwiseOptimizer` with torch's
argument names and bitsandbytes' semantics: 8-bit blockwise state by default
(``optim_bits=32`` for float32 state), weight decay decoupled for Adam, AdamW, AdEMAMix
and Lion (bitsandbytes' Adam decays as AdamW does), added to the gradient for SGD,
RMSprop and Adagrad."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tightfit.optim.optimizer import BlockwiseOptimizer

__all__ = ["LAMB", "LARS", "SGD", "Adagrad", "AdEMAMix", "Adam", "AdamW", "Lion", "RMSprop"]

#: Parameters smaller than this keep 32-bit state (bitsandbytes' default).
MIN_8BIT_SIZE = 4096


def _defaults(lr: float, betas: tuple, eps: float, weight_decay: float, optim_bits: int, min_8bit_size: int) -> dict:
    return dict(
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        optim_bits=optim_bits,
        min_8bit_size=min_8bit_size,
    )


def _refuse_zero(name: str, value: Any, why: str) -> None:
    """A ValueError where ``value`` is the number 0 (other values are the group check's)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        raise ValueError(f"{name}=0 is not accepted: {why}")


class Adam(BlockwiseOptimizer):
    """Adam, with decoupled weight decay (as bitsandbytes' Adam)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        defaults = _defaults(lr, betas, eps, weight_decay, optim_bits, min_8bit_size)
        super().__init__(params, defaults, rule="adam", paged=paged)


class AdamW(Adam):
    """AdamW: Adam with a default weight decay of 0.01."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, optim_bits=optim_bits, min_8bit_size=min_8bit_size, paged=paged
        )


class AdEMAMix(BlockwiseOptimizer):
    """AdEMAMix: Adam's fast EMA mixed with a slow one (``betas[2]``, weight ``alpha``),
    optionally warmed up over ``t_alpha`` / ``t_beta3`` steps."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        defaults = _defaults(lr, betas, eps, weight_decay, optim_bits, min_8bit_size)
        defaults.update(alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3)
        super().__init__(params, defaults, rule="ademamix", paged=paged)


class Lion(BlockwiseOptimizer):
    """Lion: the sign of a mix of momentum and gradient (``betas[0]``), momentum decayed by ``betas[1]``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        defaults = _defaults(lr, betas, 0.0, weight_decay, optim_bits, min_8bit_size)
        super().__init__(params, defaults, rule="lion", paged=paged)


class SGD(BlockwiseOptimizer):
    """SGD with momentum (the momentum buffer is the state; plain SGD has none to shrink)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float,
        weight_decay: float = 0.0,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        _refuse_zero("momentum", momentum, "without momentum SGD has no state; use torch.optim.SGD")
        defaults = _defaults(lr, (momentum, 0.0), 0.0, weight_decay, optim_bits, min_8bit_size)
        super().__init__(params, defaults, rule="momentum", paged=paged)


class RMSprop(BlockwiseOptimizer):
    """RMSprop (``alpha``: the squared gradients' decay); not centered, no momentum."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        _refuse_zero("alpha", alpha, "the squared gradients' average would be the last one alone")
        defaults = _defaults(lr, (alpha, 0.0), eps, weight_decay, optim_bits, min_8bit_size)
        super().__init__(params, defaults, rule="rmsprop", paged=paged)


class Adagrad(BlockwiseOptimizer):
    """Adagrad (no learning-rate decay, no initial accumulator value)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        *,
        optim_bits: int = 8,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        defaults = _defaults(lr, (0.0, 0.0), eps, weight_decay, optim_bits, min_8bit_size)
        super().__init__(params, defaults, rule="adagrad", paged=paged)


class LAMB(Adam):
    """Adam whose update's norm is bounded by ``max_unorm`` times the parameter's norm, per
    parameter (the layer-wise trust ratio of LAMB, as bitsandbytes bounds it); 32-bit state
    only: an 8-bit parameter steps as Adam."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_unorm: float = 1.0,
        *,
        optim_bits: int = 32,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        defaults = _defaults(lr, betas, eps, weight_decay, optim_bits, min_8bit_size) | {"max_unorm": max_unorm}
        BlockwiseOptimizer.__init__(self, params, defaults, rule="adam", paged=paged)


class LARS(BlockwiseOptimizer):
    """SGD with momentum whose update's norm is bounded by ``max_unorm`` times the
    parameter's norm (LARS's layer-wise trust ratio, as bitsandbytes bounds it)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float,
        weight_decay: float = 0.0,
        max_unorm: float = 0.02,
        *,
        optim_bits: int = 32,
        min_8bit_size: int = MIN_8BIT_SIZE,
        paged: bool = False,
    ) -> None:
        _refuse_zero("momentum", momentum, "LARS steps with a momentum buffer")
        defaults = _defaults(lr, (momentum, 0.0), 0.0, weight_decay, optim_bits, min_8bit_size)
        super().__init__(params, defaults | {"max_unorm": max_unorm}, rule="momentum", paged=paged)
