"""The Triton kernels against the reference kernels, case by case.

They run on a CUDA GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1),
which is how they are checked on machines without a GPU. Elsewhere these tests skip.
"""

from __future__ import annotations

import pytest
import torch

from tightfit.ops import blockwise, blockwise_gemv
from tightfit.ops._registry import get_op
from zoo.triton import triton_device

DEVICE = triton_device()

#: Triton's interpreter truncates float32 to bfloat16 where GPUs round to nearest even.
INTERPRETED = DEVICE.type == "cpu"

GPU_KERNELS = {
    "quantize_blockwise": blockwise._quantize_blockwise_gpu,
    "dequantize_blockwise": blockwise._dequantize_blockwise_gpu,
    "quantize_4bit": blockwise._quantize_4bit_gpu,
    "dequantize_4bit": blockwise._dequantize_4bit_gpu,
    "gemv_4bit": blockwise_gemv._gemv_4bit_gpu,
    "gemv_blockwise": blockwise_gemv._gemv_blockwise_gpu,
}


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _as_list(result):
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("op", sorted(GPU_KERNELS))
def test_kernel_matches_reference(op):
    opdef = get_op(op)
    for case in opdef.cases():
        expected = _as_list(opdef.reference(*case.args))
        actual = _as_list(GPU_KERNELS[op](*(_to(a, DEVICE) for a in case.args)))
        for want, got in zip(expected, actual, strict=True):
            got = got.cpu()
            assert got.dtype == want.dtype and got.shape == want.shape, case.name
            if opdef.metric != "bitwise":
                error = (got.double() - want.double()).pow(2).mean() / want.double().pow(2).mean().clamp(min=1e-30)
                assert error < opdef.metric, (case.name, float(error))
            elif INTERPRETED and got.dtype == torch.bfloat16:
                torch.testing.assert_close(got, want, rtol=2**-7, atol=0, msg=case.name)
            else:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), case.name


def test_quantize_marks_nan_blocks_for_rejection():
    A = torch.randn(300, device=DEVICE)
    A[130] = float("nan")
    _, absmax = blockwise._quantize_4bit_gpu(A, 64, "nf4", torch.uint8)
    assert torch.isnan(absmax[2]) and torch.isfinite(absmax[[0, 1, 3, 4]]).all()
    _, absmax = blockwise._quantize_blockwise_gpu(A, blockwise.dynamic_map().to(DEVICE), 64)
    assert torch.isnan(absmax[2]) and torch.isfinite(absmax[[0, 1, 3, 4]]).all()


def test_gemv_many_tokens_uses_dequantize_and_matmul():
    weight = torch.randn(48, 64)
    packed, absmax = blockwise._quantize_4bit_reference(weight, 64, "nf4", torch.uint8)
    x = torch.randn(2, 20, 64)
    want = blockwise_gemv._gemv_4bit_reference(x, packed, [48, 64], absmax, 64, "nf4")
    got = blockwise_gemv._gemv_4bit_gpu(x.to(DEVICE), packed.to(DEVICE), [48, 64], absmax.to(DEVICE), 64, "nf4").cpu()
    assert got.shape == (2, 20, 48)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
