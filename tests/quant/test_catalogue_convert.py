"""Each storage format's declared conversion scratch (``convert_bytes``) bounds what
converting a weight allocates above the stored result, by the CPU allocator's peak: what
the planner counts while a checkpoint streams in."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from tightfit.memory.measure import allocated_peak
from tightfit.quant import storage_formats

FORMATS = [storage for storage in storage_formats() if storage.decodes]


@pytest.fixture(scope="module", autouse=True)
def _first_use():
    """Convert a weight to each format once: the tables a process builds at a format's first
    conversion and keeps (code tables, float8's cast table from a 16-bit type) are not a
    weight's."""
    for storage in FORMATS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            storage.apply(nn.Sequential(nn.Linear(256, 256)).to(dtype), frozenset({"0"}))


@pytest.mark.parametrize("storage", FORMATS, ids=lambda storage: storage.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
# (2048, 2048): 1024 8-bit blocks, whose finite check outgrows the small-weight floor
@pytest.mark.parametrize("shape", [(512, 1024), (1000, 333), (2048, 2048)], ids=str)
@pytest.mark.usefixtures("older_objects_frozen")
def test_converting_allocates_at_most_the_declared_scratch(storage, dtype, shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False)).to(dtype).eval()
    gc.collect()  # an earlier test's weights freed inside the measurement would lower the allocator's count
    peak = allocated_peak(lambda: storage.apply(model, frozenset({"0"})))
    if model[0].weight.dtype == dtype:  # left as it is (bfloat16 storage of a 2-byte weight): nothing converted
        assert peak == 0 and storage.convert_bytes(shape, dtype) == 0
        return
    declared = storage.stored_bytes(shape, dtype) + storage.convert_bytes(shape, dtype)
    assert peak <= declared
    # exact, but for 8-bit's 4 KiB floor for small weights and float8's row scales (4 bytes a row)
    assert declared - peak <= max(4096, 4 * shape[0])
