"""``QuantState ==`` compares by value, as bitsandbytes' does: a state equals its reloaded,
copied or pickled self and differs when any field or any tensor value does; unhashable."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from tightfit.quant import functional as QF
from tightfit.quant.state import QuantState


def state(nested: bool = True, quant_type: str = "nf4") -> QuantState:
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    return QF.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type=quant_type)[1]


def nudged(tensor: torch.Tensor) -> torch.Tensor:
    changed = tensor.clone()
    changed.view(-1)[-1] += 1
    return changed


@pytest.mark.parametrize("nested", [False, True])
def test_equal_to_its_copies_and_reloads(nested):
    original = state(nested)
    for other in (
        original,
        copy.deepcopy(original),
        pickle.loads(pickle.dumps(original)),
        QuantState.from_dict(original.as_dict(packed=True)),
        QuantState.from_dict(original.as_dict()),
    ):
        assert original == other and not original != other


def test_any_difference_makes_unequal():
    original = state()
    inner = original.state2
    changes = [
        dataclasses.replace(original, absmax=nudged(original.absmax)),
        dataclasses.replace(original, code=nudged(original.code)),
        dataclasses.replace(original, blocksize=128),
        dataclasses.replace(original, dtype=torch.bfloat16),
        dataclasses.replace(original, shape=(96, 64)),
        dataclasses.replace(original, quant_type="fp4"),
        dataclasses.replace(original, offset=original.offset + 1),
        dataclasses.replace(original, state2=dataclasses.replace(inner, absmax=nudged(inner.absmax))),
        dataclasses.replace(original, absmax=original.absmax.double()),
        dataclasses.replace(original, offset=None, state2=None),
        original.to("meta"),
    ]
    for other in changes:
        assert original != other and other != original
    assert original != original.as_dict() and original != None  # noqa: E711


def test_meta_states_have_no_values_so_equal_only_themselves():
    on_meta = state().to("meta")
    assert on_meta == on_meta
    assert on_meta != state().to("meta")


def test_unhashable_because_equal_states_hold_different_tensors():
    with pytest.raises(TypeError, match="unhashable"):
        hash(state())


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_equal_to_the_state_bitsandbytes_writes_for_the_same_weight(quant_type):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    theirs = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type=quant_type)[1]
    assert QuantState.from_dict(theirs.as_dict(packed=True)) == state(nested=False, quant_type=quant_type)
