"""A training step measured the way the training fit predicts it (:mod:`tightfit.fitting.training`):
the forward, the backward from the loss (the scalar outputs that need a gradient, else
every output that does, each with a gradient of ones), the optimizer's step, the
gradients set to None. The steps before the measured one are not tracked: the first makes the
optimizer's state, which the measured step then holds from its start."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tightfit._validate import check_count, check_type
from tightfit.memory.measure import Measurement, measure, tensor_bytes
from tightfit.memory.trace import _loss_outputs, _returned_tensors
from tightfit.quant import unregistered_tensors

__all__ = ["measure_training_step"]


def measure_training_step(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    *,
    steps: int = 2,
) -> tuple[Measurement, list[float]]:
    """Run ``steps`` training steps of ``model(*args, **kwargs)`` with ``optimizer`` and
    measure the last: its seconds and its peak on ``device``; and each step's loss (the
    outputs the backward starts from, summed), the measured one's from its timed run
    (:func:`~tightfit.memory.measure` runs it again to count its bytes, so the model
    takes two more steps than the losses show; three on the CPU, where the allocator's
    events are read in one more). On the CPU the peak counts
    the weights (a quantized layer's scales too), the tensor inputs and the optimizer's
    state held before the step, and the tensors the step creates (:func:`~tightfit.memory.measure`)."""
    check_type("model", model, nn.Module)
    check_type("optimizer", optimizer, torch.optim.Optimizer)
    check_count("steps", steps, least=1)
    name = type(model).__name__

    def step() -> float:
        outs = _returned_tensors(model(*args, **kwargs))
        chosen = _loss_outputs(outs, name)
        del outs  # a training step keeps the loss, not the other outputs
        torch.autograd.backward(chosen, [torch.ones_like(out) for out in chosen])
        loss = sum(float(out.detach().sum()) for out in chosen)
        del chosen
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # at the end: a measured step starts with no gradient alive
        return loss

    optimizer.zero_grad(set_to_none=True)
    losses = [step() for _ in range(steps - 1)]
    inputs = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    weights = [*model.parameters(), *model.buffers(), *unregistered_tensors(model)]  # a quantized layer's scales too
    held = tensor_bytes([*weights, *inputs, *state])
    measured = measure(step, device, repeat=1, warmup=0, baseline_bytes=held, keep_results=True)
    return measured, [*losses, *measured.results]
