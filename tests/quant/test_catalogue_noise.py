"""Each storage format's ``noise`` (the planner's quality term) is what it measures: the
relative RMS error of a layer's output with its weight stored so, Gaussian weights and
inputs, on shapes the figure does not depend on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tightfit.quant import storage_formats


@pytest.mark.parametrize("storage", storage_formats(), ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(512, 256), (256, 1024)])
def test_declared_noise_is_the_measured_output_error(storage, shape):
    torch.manual_seed(0)
    exact = nn.Linear(shape[1], shape[0], bias=False)
    nn.init.normal_(exact.weight, std=0.02)
    stored = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False))
    stored[0].weight.data.copy_(exact.weight.data)
    storage.apply(stored, frozenset({"0"}))
    x = torch.randn(64, shape[1])
    with torch.no_grad():
        want, got = exact(x), stored(x)
    measured = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
    assert measured == pytest.approx(storage.noise, rel=0.15, abs=1e-6)
