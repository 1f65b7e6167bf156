"""Each storage format's declared conversion scratch (``convert_bytes``) bounds what
converting a weight allocates above the stored result, by the CPU allocator's peak: what
the planner counts while a checkpoint streams in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tightfit.memory.measure import allocated_peak
from tightfit.quant import storage_formats

FORMATS = [storage for storage in storage_formats() if storage.decodes]


@pytest.mark.parametrize("storage", FORMATS, ids=lambda storage: storage.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(512, 1024), (1000, 333)], ids=str)
def test_converting_allocates_at_most_the_declared_scratch(storage, dtype, shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False)).to(dtype).eval()
    peak = allocated_peak(lambda: storage.apply(model, frozenset({"0"})))
    declared = storage.stored_bytes(shape, dtype) + storage.convert_bytes(shape, dtype)
    assert peak <= declared
    full = shape[0] * shape[1] * dtype.itemsize
    assert declared - peak <= full  # a bound, not a guess: never more than one more full-precision copy
