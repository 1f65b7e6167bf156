"""The optimizer updates' Triton kernels against the reference kernels, case by case (the
conformance cases), on a CUDA GPU or on the CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tightfit.ops import optimizer
from tightfit.ops._registry import get_op
from zoo.triton import triton_device

DEVICE = triton_device()

#: Triton's interpreter truncates float32 to bfloat16 and float16 where GPUs round to nearest even.
INTERPRETED = DEVICE.type == "cpu"
GPU_KERNELS = {
    "optimizer_update_32bit": optimizer._update_32bit_gpu,
    "optimizer_update_8bit_blockwise": optimizer._update_8bit_gpu,
}


def _on(value, device):
    return value.clone().to(device) if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("op", sorted(GPU_KERNELS))
def test_kernel_matches_reference(op):
    opdef = get_op(op)
    for case in opdef.cases():
        expected = [_on(a, "cpu") for a in case.args]
        opdef.reference(*expected)
        actual = [_on(a, DEVICE) for a in case.args]
        GPU_KERNELS[op](*actual)
        for index in opdef.mutated:
            want, got = expected[index], actual[index]
            if want is None:
                continue
            got = got.cpu()
            if INTERPRETED and got.dtype in (torch.bfloat16, torch.float16):
                torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6, msg=case.name)
            else:
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (case.name, index)
