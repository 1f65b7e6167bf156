"""A forward that depends on tensor values cannot be planned on fake tensors: plan_memory and fit say so,
where in the model's code, and what to do, instead of torch's bare exception."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

import tightfit
from zoo.lm import figures


class Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum() > 0:  # BRANCH
            return y * 2
        return y


class Item(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * int(x.abs().max())  # ITEM


class Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y[y > 0].sum()  # MASK


def _line(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(number for number, line in enumerate(lines, 1) if line.endswith(f"# {marker}"))


FIGURES = figures()
PLANNERS = {
    "compiled": lambda model, x: tightfit.plan_memory(model, x),
    "eager": lambda model, x: tightfit.plan_memory(model, x, runtime="eager"),
    "training": lambda model, x: tightfit.plan_memory(model, x, training=True),
    "fit": lambda model, x: tightfit.fit(model, x, "1MB", calibration=FIGURES),  # figures given: nothing to calibrate
}


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize(
    ("model", "marker", "what", "cause"),
    [
        (Branches, "BRANCH", "reads a tensor's value into Python", DataDependentOutputException),
        (Item, "ITEM", "reads a tensor's value into Python", DataDependentOutputException),
        (Masked, "MASK", "makes a tensor whose shape depends on values", DynamicOutputShapeException),
    ],
)
def test_a_forward_that_depends_on_values_is_refused_clearly(model, marker, what, cause, planner):
    with pytest.raises(ValueError) as caught:
        PLANNERS[planner](model(), torch.randn(4, 8))
    message = str(caught.value)
    assert message.startswith(f"{model.__name__}'s forward {what}")
    assert f") at {__file__}:{_line(marker)} (forward): " in message  # the model's own line
    assert "a plan runs the model on fake tensors, which have shapes but no values" in message
    assert "torch.where instead of a Python branch" in message and "tightfit.memory.measure" in message
    assert "\n" not in message and isinstance(caught.value.__cause__, cause)


def test_a_branch_on_shapes_still_plans():
    class OnShape(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if x.shape[0] > 2 else x

    assert tightfit.plan_memory(OnShape(), torch.randn(4, 8)).devices["cpu"].inputs_bytes == 128
