"""The cached code tables (dynamic maps, 4-bit codes) are real tensors however they were first asked for."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from tightfit.ops import blockwise, codes


def test_tables_first_built_under_a_fake_mode_are_real():
    """A skeleton converted under a fake mode (to plan its memory) must not leave a fake
    table in the cache for real calls after."""
    for cached in (codes._dynamic_map, codes._code_4bit, blockwise._code_on, blockwise._sorted_code):
        cached.cache_clear()
    with FakeTensorMode():
        built = [codes._dynamic_map(True), codes._code_4bit("nf4"), blockwise._code_on("fp4", torch.device("cpu"))]
        built += list(blockwise._sorted_code("nf4", torch.device("cpu")))
    assert not any(is_fake(table) for table in built)
    assert torch.equal(codes.dynamic_map(), codes._dynamic_map(True))
