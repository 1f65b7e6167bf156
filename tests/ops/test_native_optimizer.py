"""The optimizer steps' CPU kernels, every path pinned in turn (each native instruction-set
path, and none: numba's kernels), bit for bit against the reference on the conformance
cases: every rule, 8-bit and 32-bit state, float32, bfloat16 and float16 parameters, full
and partial blocks."""

from __future__ import annotations

import pytest
import torch

from tightfit.ops import get_op


def _copies(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("op", ["optimizer_update_8bit_blockwise", "optimizer_update_32bit"])
def test_every_path_is_the_reference_bit_for_bit(kernel, op):
    opdef = get_op(op)
    cpu = opdef.kernels["cpu"].fn
    for case in opdef.cases():
        expected, actual = _copies(case.args), _copies(case.args)
        opdef.reference(*expected)
        cpu(*actual)
        for index in opdef.mutated:
            if expected[index] is not None:
                assert torch.equal(actual[index].view(torch.uint8), expected[index].view(torch.uint8)), (
                    case.name,
                    index,
                )


def test_a_nan_gradient_codes_as_the_reference_codes_it(kernel):
    opdef = get_op("optimizer_update_8bit_blockwise")
    case = next(c for c in opdef.cases() if c.name.startswith("adam torch.float32"))
    args = _copies(case.args)
    args[1][[3, 300]] = float("nan")  # two blocks whose new states are NaN
    expected, actual = _copies(args), _copies(args)
    opdef.reference(*expected)
    opdef.kernels["cpu"].fn(*actual)
    for index in opdef.mutated:
        if expected[index] is not None:
            assert torch.equal(actual[index].view(torch.uint8), expected[index].view(torch.uint8)), index
