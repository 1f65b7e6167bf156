"""The int8 matmul's CUDA kernel (``torch._int_mm`` with its shape rule met by zero
padding) against the reference, exact. ``torch._int_mm`` runs on the CPU too, so the
padding and cutting are checked on any machine; on a GPU the same shapes run there."""

from __future__ import annotations

import pytest
import torch

from tightfit.ops import int8

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [  # (leading dims of A, K, N): one decoding token, odd widths, the aligned case, batches, empties
    ((1,), 4096 // 8, 40),
    ((1,), 61, 5),
    ((3,), 64, 48),
    ((17,), 64, 48),
    ((2, 9), 33, 19),
    ((0,), 16, 8),
    ((4,), 0, 8),
    ((4,), 16, 0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("lead", "K", "N"), SHAPES)
def test_padded_int_mm_is_exact(device, lead, K, N):
    generator = torch.Generator().manual_seed(K * 31 + N)
    A = torch.randint(-128, 128, (*lead, K), dtype=torch.int8, generator=generator)
    B = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=generator)
    expected = int8._linear_matmul_reference(A, B)
    got = int8._linear_matmul_int_mm(A.to(device), B.to(device)).cpu()
    assert got.dtype == torch.int32 and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_extremes_sum_exactly_in_int32():
    A = torch.full((1, 4096), -128, dtype=torch.int8)
    B = torch.full((8, 4096), -128, dtype=torch.int8)
    assert int8._linear_matmul_int_mm(A, B).unique().tolist() == [128 * 128 * 4096]
