"""The out= variant of an aten op, found from its schema, and why there is none."""

from __future__ import annotations

import operator

import pytest
import torch

from tightfit.graph.out_variants import out_variant

aten = torch.ops.aten


@pytest.mark.parametrize(
    "op, overload, names",
    [
        (aten.mm.default, aten.mm.out, ("out",)),
        (aten.add.Tensor, aten.add.out, ("out",)),
        (aten.sum.dim_IntList, aten.sum.IntList_out, ("out",)),  # not called ".out"
        (aten.max.dim, aten.max.dim_max, ("max", "max_values")),  # one out per result
    ],
)
def test_the_out_overload_takes_the_same_arguments_and_one_out_per_result(op, overload, names):
    found, why = out_variant(op, "cpu")
    assert why == "" and found.op is overload and found.names == names


@pytest.mark.parametrize(
    "target, reason",
    [
        (aten.t.default, "no out= variant"),  # a view
        (aten.add_.Tensor, "no out= variant"),  # in place
        (aten._scaled_dot_product_flash_attention_for_cpu.default, "no out= variant"),
        (aten.clone.default, "out= variant generated (computes, then copies) on cpu"),
        (operator.getitem, "not an aten op"),
    ],
)
def test_ops_that_cannot_write_into_the_arena_say_why(target, reason):
    assert out_variant(target, "cpu") == (None, reason)
