"""Issue 15: casting a quantized layer (``.half()``, ``.to(dtype)``) casts its bias only;
the stored format keeps its dtypes, and checkpoints move to and from bitsandbytes'
``Linear8bitLt`` with ``strict=True``."""

from __future__ import annotations

import pytest
import torch

import tightfit.quant.fuzz as quant_fuzz
from tightfit.quant import Linear4bit, LinearInt8

KINDS = {
    **quant_fuzz.KINDS,
    "nf4-bf16-storage": lambda linear: Linear4bit.from_linear(linear, quant_storage=torch.bfloat16),
    "fp4-f16-storage": lambda linear: Linear4bit.from_linear(linear, quant_type="fp4", quant_storage=torch.float16),
}
CASTS = {
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to(float16)": lambda m: m.to(torch.float16),
    "to(cpu, bfloat16)": lambda m: m.to("cpu", torch.bfloat16),
    "half().float()": lambda m: m.half().float(),
}


def _format_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    if isinstance(module, LinearInt8):
        return [module.weight, module.SCB]
    return [module.weight, *module.quant_state.tensors()]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_cast_keeps_the_format_and_the_layer_works(kind, cast):
    linear = quant_fuzz.linear(0)
    layer = KINDS[kind](linear)
    before = [t.clone() for t in _format_tensors(layer)]
    x = torch.randn(3, linear.in_features)
    expected = layer(x)
    CASTS[cast](layer)
    after = _format_tensors(layer)
    assert [t.dtype for t in after] == [t.dtype for t in before]
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(after, before))  # packed bf16 codes may be NaN
    dtype = {"half": torch.float16, "to(float16)": torch.float16, "half().float()": torch.float32}.get(
        cast, torch.bfloat16
    )
    assert layer.bias.dtype == dtype
    out = layer(x.to(dtype))
    assert out.dtype == dtype  # the output follows the activation, as nn.Linear's does
    tolerance = 0 if dtype == torch.float32 and cast != "half().float()" else 0.05
    torch.testing.assert_close(out.float(), expected, atol=tolerance + 0.02 * (dtype != torch.float32), rtol=0.05)


def test_int8_checkpoints_load_both_ways_with_strict():
    bnb = pytest.importorskip("bitsandbytes")
    linear = quant_fuzz.linear(0)
    theirs = bnb.nn.Linear8bitLt(37, 7, has_fp16_weights=False)
    theirs.load_state_dict(linear.state_dict())
    theirs = theirs.to("cpu")  # quantizes
    ours = KINDS["int8"](quant_fuzz.linear(1))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert torch.equal(ours.weight, theirs.weight.data) and torch.equal(ours.SCB, theirs.weight.SCB)
    written = ours.state_dict()
    assert set(written) == set(theirs.state_dict())
    assert written["weight_format"].dtype == torch.uint8 and int(written["weight_format"]) == 0
    back = bnb.nn.Linear8bitLt(37, 7, has_fp16_weights=False)
    back.load_state_dict(quant_fuzz.linear(2).state_dict())
    back = back.to("cpu")
    back.load_state_dict(written, strict=True)
    assert torch.equal(back.weight.data, ours.weight) and torch.equal(back.weight.SCB, ours.SCB)
    x = torch.randn(2, 37)
    torch.testing.assert_close(back(x).float(), theirs(x).float())
    again = KINDS["int8"](quant_fuzz.linear(3))
    again.load_state_dict(written, strict=True)
    assert torch.equal(again.SCB, ours.SCB)
