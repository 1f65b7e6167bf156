"""An optimizer's step by the specification: the reference kernel of the op the optimizer
calls, with the hyperparameters it passes (AdEMAMix's schedules included), for tests that
hold tightfit's optimizers, and bitsandbytes', to it."""

from __future__ import annotations

from typing import Any

import torch

from tightfit.ops import get_op
from tightfit.optim.optimizer import scheduled


def spec_step(optimizer: torch.optim.Optimizer, state: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> None:
    """One step of ``optimizer``'s rule (its first group's settings) on ``p`` and ``state``
    in place: a state in tightfit's and bitsandbytes' layout, its ``step`` counted up."""
    group, rule = optimizer.param_groups[0], optimizer.rule
    step = state["step"] + 1
    alpha, beta3 = scheduled(group, step) if rule == "ademamix" else (0.0, 0.0)
    scalars = (
        group["betas"][0],
        group["betas"][1],
        beta3,
        alpha,
        group["eps"],
        group["weight_decay"],
        step,
        group["lr"],
    )
    if state["state1"].dtype == torch.uint8:
        get_op("optimizer_update_8bit_blockwise").reference(
            rule, grad, p, state["state1"], state.get("state2"), state["absmax1"], state.get("absmax2"),
            state["qmap1"], state.get("qmap2"), *scalars,
        )  # fmt: skip
    else:
        get_op("optimizer_update_32bit").reference(rule, grad, p, state["state1"], state.get("state2"), *scalars)
    state["step"] = step


def copied(state: dict[str, Any]) -> dict[str, Any]:
    """A state with its tensors copied."""
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
