"""``bitsandbytes.optim.ademamix``: the AdEMAMix classes, and ``_ReferenceAdEMAMix``, the
plain-torch AdEMAMix that bitsandbytes' own tests hold its optimizers to (state ``m1_m2``,
the two EMAs stacked, and ``nu``; float32 state in the parameter's dtype; the step counted
per group), so that those tests run here unchanged."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from tightfit.compat.bitsandbytes.optim import (
    AdEMAMix,
    AdEMAMix8bit,
    AdEMAMix32bit,
    PagedAdEMAMix,
    PagedAdEMAMix8bit,
    PagedAdEMAMix32bit,
)

__all__ = ["AdEMAMix", "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit"]


class _ReferenceAdEMAMix(torch.optim.Optimizer):
    """AdEMAMix (Pagliardini et al., 2024) in torch operations, with its alpha and beta3 warm-ups."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        t_beta3: int | None = None,
        t_alpha: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, alpha=alpha, eps=eps, weight_decay=weight_decay, t_beta3=t_beta3, t_alpha=t_alpha
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            step = group["step"]
            beta1, beta2, beta3 = group["betas"]
            alpha, t_alpha, t_beta3 = group["alpha"], group["t_alpha"], group["t_beta3"]
            if t_alpha is not None:
                alpha = min(step * alpha / t_alpha, alpha)
            if t_beta3 is not None:
                log1, log3, scale = math.log(beta1), math.log(beta3), step / t_beta3
                beta3 = min(math.exp((log1 * log3) / ((1 - scale) * log3 + scale * log1)), beta3)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m1_m2"] = p.new_zeros((2, *p.shape))
                    state["nu"] = torch.zeros_like(p)
                fast, slow, second = state["m1_m2"][0], state["m1_m2"][1], state["nu"]
                fast.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                slow.mul_(beta3).add_(p.grad, alpha=1 - beta3)
                second.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denominator = second.sqrt().div_(math.sqrt(1 - beta2**step)).add_(group["eps"])
                update = (fast / (1 - beta1**step) + alpha * slow) / denominator
                p.add_(update.add_(p, alpha=group["weight_decay"]), alpha=-group["lr"])
        return loss
