"""Contracts of bitsandbytes that its own test suite checks, run with bitsandbytes and
with ``tightfit.compat.bitsandbytes`` in its place: ``functional.has_avx512bf16``, a
``Linear8bitLt`` whose weight was replaced by a plain parameter (tied weights) saves no
``SCB`` and refuses an int8 checkpoint, ``bnb.matmul`` takes the int8 weight as ``state.CB.t()`` and ``bnb.matmul_4bit`` a
weight quantized (in x out), with bitsandbytes' DeprecationWarning. Decoded values are held to
the specification (tightfit's reference kernels on the stored bytes), bitsandbytes' through
``zoo.peer.PeerCheck``: an xfail naming the deviation where its CPU kernel departs from it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

import tightfit.compat.bitsandbytes as tnb
from zoo.peer import PeerCheck, spec_dequantize_4bit

MODULES = ["tightfit", "bitsandbytes"]


@pytest.fixture(params=MODULES)
def bnb(request):
    return tnb if request.param == "tightfit" else pytest.importorskip("bitsandbytes")


def test_has_avx512bf16_says_no_repacked_layout():
    assert tnb.functional.has_avx512bf16() is False
    bnb = pytest.importorskip("bitsandbytes")
    theirs = inspect.signature(bnb.functional.has_avx512bf16).parameters
    assert inspect.signature(tnb.functional.has_avx512bf16).parameters == theirs


def test_tied_weight_state_dict_has_no_scales(bnb):
    linear = bnb.nn.Linear8bitLt(8, 4, bias=False, has_fp16_weights=False)
    linear.weight = nn.Parameter(torch.randn(4, 8))
    assert list(linear.state_dict()) == ["weight"]


def test_tied_weight_is_quantized_at_the_first_call_and_then_saves_its_scales():
    linear = tnb.nn.Linear8bitLt(8, 4, bias=False, has_fp16_weights=False)
    linear.weight = nn.Parameter(torch.randn(4, 8))
    out = linear(torch.randn(3, 8))
    assert out.shape == (3, 4) and bool(torch.isfinite(out).all())
    assert sorted(linear.state_dict()) == ["SCB", "weight", "weight_format"]


def test_int8_checkpoint_into_a_tied_weight_is_refused_and_keeps_the_tie(bnb):
    linear = bnb.nn.Linear8bitLt(8, 4, bias=False, has_fp16_weights=False)
    tied = nn.Parameter(torch.randn(4, 8))
    linear.weight = tied
    source = bnb.nn.Linear8bitLt(8, 4, bias=False, has_fp16_weights=False).to("cpu")
    with pytest.raises(RuntimeError, match="Loading a quantized checkpoint into non-quantized Linear8bitLt"):
        linear.load_state_dict(source.state_dict())
    assert linear.weight is tied


def quantized_state(bnb, out_features: int, in_features: int):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    state = bnb.MatmulLtState()
    state.has_fp16_weights = False
    state.CB, state.SCB, _ = bnb.functional.int8_vectorwise_quant(weight.half())
    return weight, state


@pytest.mark.parametrize(("out_features", "in_features"), [(48, 32), (16, 16)])
def test_matmul_takes_the_weight_as_the_transposed_view_of_state_cb(bnb, out_features, in_features):
    weight, state = quantized_state(bnb, out_features, in_features)
    A = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1))
    direct = bnb.matmul(A, state.CB, state=state)
    transposed = bnb.matmul(A, state.CB.t(), state=state)
    assert transposed.shape == (5, out_features)
    assert torch.equal(transposed, direct)
    assert (transposed - A @ weight.t()).abs().mean() < 0.05


def test_transposed_with_out_and_a_transposed_copy_refused():
    weight, state = quantized_state(tnb, 48, 32)
    A = torch.randn(5, 32)
    out = torch.empty(5, 48)
    result = tnb.matmul(A, state.CB.t(), out=out, state=state)
    assert result is out and torch.equal(out, tnb.matmul(A, state.CB, state=state))
    with pytest.raises(ValueError, match=r"B must be the int8 weight \(out x 32\).*state.CB.t\(\).*got \(32, 48\)"):
        tnb.matmul(A, state.CB.t().contiguous(), state=state)
    with pytest.raises(ValueError, match="out must be"):
        tnb.matmul(A, state.CB.t(), out=torch.empty(5, 32), state=state)


def test_matmul_4bit_takes_an_in_by_out_weight_with_bitsandbytes_warning():
    weight = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))  # (in x out)
    A = torch.randn(3, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    bias = torch.ones(48)
    results, states = [], []
    for name in MODULES:
        bnb = tnb if name == "tightfit" else pytest.importorskip("bitsandbytes")
        packed, state = bnb.functional.quantize_4bit(weight, quant_type="nf4")
        with pytest.warns(DeprecationWarning, match="orientation"):
            out = bnb.matmul_4bit(A, packed, state, bias=bias)
        results.append((out, torch.autograd.grad(out.sum(), A)[0]))
        states.append((packed, state))
    (ours, our_grad), (theirs, their_grad) = results
    (our_packed, our_state), (their_packed, their_state) = states
    assert torch.equal(our_packed, their_packed) and torch.equal(our_state.absmax, their_state.absmax)
    assert tuple(our_state.shape) == tuple(their_state.shape) == (32, 48)
    decoded = spec_dequantize_4bit(their_packed, their_state)
    expected = torch.nn.functional.linear(A, decoded.t(), bias)
    expected_grad = torch.autograd.grad(expected.sum(), A)[0]
    assert ours.shape == (3, 48)
    assert torch.equal(ours, expected) and torch.equal(our_grad, expected_grad)
    peer = PeerCheck()
    peer.agrees("bitsandbytes.matmul_4bit (in x out weight, its dequantize_4bit)", theirs, expected)
    peer.agrees("bitsandbytes.matmul_4bit's input gradient", their_grad, expected_grad)
    peer.settle()


def test_matmul_4bit_in_by_out_checks_bias_and_out_first():
    packed, state = tnb.functional.quantize_4bit(torch.randn(32, 48), quant_type="nf4")
    A = torch.randn(3, 32)
    with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \(48,\)"):
        tnb.matmul_4bit(A, packed, state, bias=torch.ones(32))
    with pytest.raises(ValueError, match="out must be"):
        tnb.matmul_4bit(A, packed, state, out=torch.empty(3, 32))
    with pytest.raises(ValueError, match="A.dtype"):
        tnb.matmul_4bit(A.to(torch.float64), packed, state)


def test_quant_state_is_frozen_and_to_returns_the_moved_copy():
    """The two differences docs/migrating.md lists: bitsandbytes' QuantState is mutable and its
    ``.to()`` moves in place (returning None); tightfit's is frozen and ``.to()`` returns the
    moved state, leaving the original where it was. A state left behind is refused at the
    next decode, naming absmax."""
    packed, state = tnb.functional.quantize_4bit(torch.randn(16, 64), quant_type="nf4", compress_statistics=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.blocksize = 128
    moved = state.to("meta")
    assert moved is not state and moved.absmax.is_meta and moved.state2.absmax.is_meta
    assert state.absmax.device.type == state.state2.absmax.device.type == "cpu"
    assert moved.state2 is not state.state2
    with pytest.raises(ValueError, match="absmax is on meta but A is on cpu"):
        tnb.functional.dequantize_4bit(packed, moved)
    layer = tnb.nn.Linear4bit(64, 16, quant_type="nf4").to("cpu")  # quantizes
    weight = layer.weight.to("meta")  # Params4bit.to moves its state, here and on the layer, as bitsandbytes'
    assert weight.is_meta and weight.quant_state.absmax.is_meta and layer.quant_state.absmax.is_meta
    bnb = pytest.importorskip("bitsandbytes")
    _, theirs = bnb.functional.quantize_4bit(torch.randn(16, 64), quant_type="nf4", compress_statistics=True)
    assert theirs.to("meta") is None and theirs.absmax.is_meta  # bitsandbytes: in place
    theirs.blocksize = 128  # and mutable
