"""A training step measured the way the training fit predicts it (:mod:`tightfit.fitting.training`):
the forward, the backward from the loss (the scalar outputs that need a gradient, else
every output that does, each with a gradient of ones), the optimizer's step, the
gradients set to None. The steps before the measured one are not tracked: the first makes the
optimizer's state, which the measured step then holds from its start."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tightfit._validate import check_count, check_type
from tightfit.backends import get
from tightfit.backends.cpu import read_process_memory, reset_process_peak
from tightfit.memory.measure import Measurement, allocated_peak, tensor_bytes
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
    """Run ``steps`` training steps of ``model(*args, **kwargs)`` with ``optimizer``, the last
    timed, then one more whose peak on ``device`` is read from the allocator; returns that
    measurement and the ``steps`` losses (the outputs the backward starts from, summed).

    The peak is the allocator's: on an accelerator its statistics, on the CPU its events
    (:func:`~tightfit.memory.allocated_peak`) above the weights (a quantized layer's scales
    too), the tensor inputs and the optimizer's state held before the step. Not the
    live-tensor count: that runs under a dispatch mode, where autograd sums gradients out of
    place, a copy eager PyTorch never makes."""
    check_type("model", model, nn.Module)
    check_type("args", args, (tuple, list))
    check_type("kwargs", kwargs, Mapping)
    check_type("optimizer", optimizer, torch.optim.Optimizer)
    check_count("steps", steps, least=1)
    backend = get(device)
    device = backend.resolve_device(device)
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
    backend.synchronize(device)
    started = time.perf_counter()
    losses.append(step())
    backend.synchronize(device)
    seconds = time.perf_counter() - started
    inputs = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    weights = [*model.parameters(), *model.buffers(), *unregistered_tensors(model)]
    held = tensor_bytes([t for t in [*weights, *inputs, *state] if t.device == device])
    if device.type != "cpu":
        backend.reset_peak_memory(device)
        step()
        backend.synchronize(device)
        info = backend.memory(device)
        return Measurement(str(device), [seconds], held, info.peak, None, info.source, None, info.peak), losses
    rss_reset = reset_process_peak()
    peak = held + allocated_peak(step)
    rss = read_process_memory()[1] if rss_reset else None
    source = "the CPU allocator's events above the weights, inputs and optimizer state"
    return Measurement(str(device), [seconds], held, peak, rss, source, None, peak), losses
