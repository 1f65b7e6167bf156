"""A :class:`~tightfit.distributed.StagePlan` run inside one process, each stage on its own
device (``plan_stages(folder, {"cuda:0": "20GB", "cpu": "64GB"}, ...)``): the stages run in
turn, the hidden states copied from one device to the next, each stage's KV cache on its
device. Each device is measured as one rank is (live tensors on the CPU, the allocator's
peak on an accelerator) in the same measured call."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tightfit import backends
from tightfit._validate import check_count, check_type
from tightfit.distributed.measured import timed_and_measured
from tightfit.distributed.plan import StagePlan
from tightfit.distributed.run import StageRun, load_stage, stage_report
from tightfit.distributed.step import StageStep
from tightfit.fitting.held import held_bytes
from tightfit.kinds import CAUSAL_LM

__all__ = ["run_local"]


class _Copies:
    """Moves a stage's output to the next stage's device, timed (the source device waited
    for) and counted."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.bytes = 0

    def __call__(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        start = time.perf_counter()
        moved = tensor.to(device)
        backends.get(device).synchronize(device)
        self.seconds += time.perf_counter() - start
        self.bytes += tensor.nbytes
        return moved


def _chained(steps: list[StageStep], copies: _Copies, new_tokens: int, parts: list[slice]) -> Callable[[], Any]:
    """One run through every stage in turn: a generation's tokens, or an encoding's
    embeddings, each micro-batch (``parts``: their rows) through every stage before the next."""

    def encode() -> torch.Tensor:
        embeddings = None
        for rows in parts:
            taken = steps[0].ids[rows]
            for step in steps:
                taken = step(copies(taken, step.device), {}, rows=rows)
            embeddings = steps[-1].into_batch(embeddings, taken, rows, len(parts))
            del taken  # not held through the next part's forward
        return embeddings

    def generate() -> tuple[int, ...]:
        caches = [step.new_cache() for step in steps]
        tokens: list[int] = []
        taken = steps[0].ids
        for index in range(new_tokens):
            for step, cache in zip(steps, caches):
                taken = step(copies(taken, step.device), cache, index)
            tokens.append(int(taken))
        return tuple(tokens)

    return generate if steps[0].kind == CAUSAL_LM else encode


def run_local(
    folder: str | Path,
    plan: StagePlan,
    inputs: Mapping[str, torch.Tensor],
    *,
    max_new_tokens: int = 0,
    repeat: int = 3,
) -> StageRun:
    """Run every stage of ``plan`` in this process, stage ``i`` on ``plan.stages[i].device``
    (each device holds one stage: stages sharing a device would share its memory, which
    their plans do not count). Each stage streams its own tensors; the report has a row
    per stage (``rank``: its index; ``link_seconds``/``sent_bytes``: the run's copies from
    device to device, per run, the same on every row)."""
    check_type("plan", plan, StagePlan)
    devices = [torch.device(stage.device) for stage in plan.stages]
    if len(set(devices)) != len(devices):
        raise ValueError(
            f"the plan puts several stages on one device ({', '.join(map(str, devices))}); in one process each "
            f"stage needs a device of its own (their plans do not count each other's memory): run such stages "
            f"as ranks (tightfit.distributed.run_stage under torchrun)"
        )
    check_count("repeat", repeat, least=1)
    plan.check_run(inputs, max_new_tokens)
    stages = [load_stage(folder, plan, index) for index in range(len(plan.stages))]
    steps = [
        StageStep(model, plan.kind, index, len(stages), device, inputs)
        for index, ((model, _, _), device) in enumerate(zip(stages, devices))
    ]
    copies = _Copies()
    held = {device: held_bytes(model, device) for (model, _, _), device in zip(stages, devices)}
    timed = timed_and_measured(
        _chained(steps, copies, max_new_tokens, plan.micro_batch_rows()), held, repeat, lambda: copies.seconds
    )
    reports = tuple(
        stage_report(plan, index, loaded, read, timed, copies.bytes // timed.calls)
        for index, (_, loaded, read) in enumerate(stages)
    )
    return StageRun.of(plan, reports, timed.result, timed.seconds)
