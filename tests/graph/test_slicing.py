"""The slicing proof: axis maps through reshapes, slices taken and put back, decided inputs."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tightfit.graph.slicing import FULL, Invalid, Sliced, _view_map, prove, put, take


@pytest.mark.parametrize(
    "src, dst, state, extent, expected",
    [
        ((2, 4, 8, 8), (8, 8, 8), Sliced(0), 2, Sliced(0, unit=4)),  # batch leads the merged dim
        ((2, 4, 8, 8), (8, 8, 8), Sliced(1), 4, Sliced(0, outer=2)),  # heads inside batch x heads
        ((8, 8, 8), (2, 4, 8, 8), Sliced(0, outer=2), 4, Sliced(1)),  # and back
        ((8, 8, 8), (2, 4, 8, 8), Sliced(0, unit=4), 2, Sliced(0)),
        ((2, 4, 8), (2, 32), Sliced(1), 4, Sliced(1, unit=8)),
        ((2, 4, 6), (4, 12), Sliced(1), 4, None),  # the axis would straddle two dimensions
    ],
)
def test_view_map(src, dst, state, extent, expected):
    assert _view_map(src, dst, state, extent) == expected


@pytest.mark.parametrize("state", [Sliced(1), Sliced(0, unit=3), Sliced(0, outer=2), Sliced(1, unit=2, outer=3)])
def test_take_then_put_rebuilds_the_whole(state):
    extent = 4
    shape = [5, 5]
    shape[state.dim] = state.size(extent)
    whole = torch.randn(shape)
    rebuilt = torch.empty_like(whole)
    for start, length in ((0, 1), (1, 2), (3, 1)):
        piece = take(whole, state, extent, start, length)
        assert piece.shape[state.dim] == state.size(length)
        put(rebuilt, piece.clone(), state, extent, start, length)
    assert torch.equal(rebuilt, whole)


def _graph(fn, *args):
    graph = make_fx(fn, tracing_mode="fake")(*args)
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    inputs = [n for n in graph.graph.nodes if n.op == "placeholder"]
    return nodes, inputs


def test_a_lower_rank_input_is_decided_by_the_op_that_needs_it():
    nodes, (x, bias, mask) = _graph(
        lambda x, b, m: (x + b).masked_fill(m, 0.0),
        torch.randn(4, 6, 5),
        torch.randn(6, 5),
        torch.ones(5, dtype=torch.bool),
    )
    proof = prove(nodes, [x, bias, mask], 1)
    assert proof.states[x] == Sliced(1)
    assert proof.states[bias] == Sliced(0)  # its dim 0 lines up with x's sliced dim 1
    assert proof.states[mask] is FULL  # broadcast along the sliced dim


def test_a_matmul_over_the_sliced_dimension_is_refused():
    nodes, (a, b) = _graph(lambda a, b: a @ b, torch.randn(4, 6), torch.randn(6, 3))
    assert prove(nodes, [a, b], 0).states[b] is FULL  # rows of a: fine
    with pytest.raises(Invalid, match="sums over"):
        prove(nodes, [a, b], 1)  # the contracted dimension


def test_addmm_reads_its_matrices_after_the_bias():
    # addmm(bias, a, b): rows of a slice the product; the bias broadcasts (it was an IndexError)
    nodes, (bias, a, b) = _graph(
        lambda bias, a, b: torch.addmm(bias, a, b), torch.randn(3), torch.randn(4, 6), torch.randn(6, 3)
    )
    proof = prove(nodes, [a, b, bias], 0)
    assert proof.states[b] is FULL and proof.states[bias] is FULL
    with pytest.raises(Invalid, match="sums over"):
        prove(nodes, [a, b, bias], 1)
