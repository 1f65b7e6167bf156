"""Huge-page backed buffers behave like torch.empty."""

from __future__ import annotations

import torch

from tightfit.ops._hugepages import empty_with_huge_pages


def test_small_and_large_buffers_are_ordinary_tensors():
    for shape in [(3,), (5, 7 * 1024 * 1024 + 3)]:
        tensor = empty_with_huge_pages(shape, torch.bfloat16)
        assert tensor.shape == shape and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
        tensor.fill_(1.5)
        assert float(tensor.float().mean()) == 1.5


def test_empty_buffer():
    assert empty_with_huge_pages((0,), torch.float32).numel() == 0
