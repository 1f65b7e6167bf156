"""Every tensor argument of ``tightfit.compat.bitsandbytes.functional`` (and the top-level
``matmul_4bit``) replaced by a tensor of another rank or shape, a 0-d one included: the call
is refused with a ValueError or TypeError that names an argument, or it computes; never an
IndexError or a RuntimeError from inside torch (D7). bitsandbytes is not needed."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit.compat.bitsandbytes as tnb
import tightfit.compat.bitsandbytes.functional as F


@dataclass(frozen=True)
class Call:
    """A valid call of ``function`` with the tensor arguments ``tensors`` (by name) and the
    other arguments ``fixed``."""

    name: str
    function: Callable[..., object]
    tensors: dict[str, torch.Tensor]
    fixed: dict[str, object]

    def __call__(self, **tensors: torch.Tensor) -> object:
        return self.function(**{**self.tensors, **tensors}, **self.fixed)


def _calls() -> list[Call]:
    generator = torch.Generator().manual_seed(0)
    W, x = torch.randn(16, 64, generator=generator), torch.randn(2, 64, generator=generator)
    packed, state = F.quantize_4bit(W, quant_type="nf4", compress_statistics=True)
    codes, state8 = F.quantize_blockwise(torch.randn(300, generator=generator), blocksize=256)
    A8 = torch.randint(-128, 128, (4, 8), generator=generator, dtype=torch.int8)
    B8 = torch.randint(-128, 128, (6, 8), generator=generator, dtype=torch.int8)
    product = torch.randint(-1000, 1000, (4, 6), generator=generator, dtype=torch.int32)
    stats = {"row_stats": torch.rand(4) + 1, "col_stats": torch.rand(6) + 1}
    return [
        Call(
            "quantize_blockwise",
            F.quantize_blockwise,
            {"A": torch.randn(300), "out": codes.clone()},
            {"blocksize": 256},
        ),
        Call(
            "quantize_blockwise(absmax=, code=)",
            F.quantize_blockwise,
            {"A": torch.randn(300), "absmax": state8.absmax.clone(), "code": state8.code.clone()},
            {"blocksize": 256},
        ),
        Call(
            "dequantize_blockwise",
            F.dequantize_blockwise,
            {"A": codes, "out": torch.empty(300)},
            {"quant_state": state8},
        ),
        Call(
            "dequantize_blockwise(absmax=, code=)",
            F.dequantize_blockwise,
            {"A": codes, "absmax": state8.absmax, "code": state8.code},
            {"blocksize": 256},
        ),
        Call(
            "quantize_4bit",
            F.quantize_4bit,
            {"A": W, "absmax": torch.empty(16), "out": torch.empty(512, 1, dtype=torch.uint8)},
            {"quant_type": "nf4"},
        ),
        Call("quantize_nf4", F.quantize_nf4, {"A": W}, {}),
        Call("dequantize_4bit", F.dequantize_4bit, {"A": packed, "out": torch.empty(16, 64)}, {"quant_state": state}),
        Call(
            "dequantize_fp4(absmax=)",
            F.dequantize_fp4,
            {"A": packed, "absmax": torch.ones(16), "out": torch.empty(16, 64)},
            {"blocksize": 64},
        ),
        Call("gemv_4bit", F.gemv_4bit, {"A": x[:1], "B": packed.t(), "out": torch.empty(1, 16)}, {"state": state}),
        Call(
            "gemm_4bit",
            F.gemm_4bit,
            {"A": x, "B": packed, "out": torch.empty(2, 16), "bias": torch.ones(16)},
            {"state": state},
        ),
        Call("matmul_4bit", tnb.matmul_4bit, {"A": x, "B": packed.t(), "bias": torch.ones(16)}, {"quant_state": state}),
        Call(
            "int8_linear_matmul",
            F.int8_linear_matmul,
            {"A": A8, "B": B8, "out": torch.empty(4, 6, dtype=torch.int32)},
            {},
        ),
        Call(
            "int8_mm_dequant",
            F.int8_mm_dequant,
            {"A": product, **stats, "out": torch.empty(4, 6), "bias": torch.ones(6)},
            {},
        ),
        Call("int8_scaled_mm", F.int8_scaled_mm, {"A": A8, "B": B8, **stats, "bias": torch.ones(6)}, {}),
        Call("int8_vectorwise_quant", F.int8_vectorwise_quant, {"A": x}, {"threshold": 1.5}),
        Call("int8_vectorwise_dequant", F.int8_vectorwise_dequant, {"A": A8, "stats": torch.rand(4) + 1}, {}),
    ]


CALLS = _calls()


@pytest.mark.parametrize("call", CALLS, ids=[call.name for call in CALLS])
def test_the_valid_calls_compute(call):
    call()


def _named(message: str, call: Call) -> bool:
    names = [*call.tensors, *call.fixed]
    return any(re.search(rf"(?<![\w.]){re.escape(name)}\b", message) for name in names)


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_tensor_argument_of_another_rank_is_refused_naming_an_argument_or_computes(data):
    call = data.draw(st.sampled_from(CALLS), label="call")
    name = data.draw(st.sampled_from(sorted(call.tensors)), label="argument")
    valid = call.tensors[name]
    shape = data.draw(st.lists(st.integers(0, 5), max_size=4).filter(lambda s: s != list(valid.shape)), label="shape")
    tensor = torch.zeros(shape, dtype=valid.dtype) if shape else valid.reshape(-1)[0].clone()
    try:
        result = call(**{name: tensor})
    except (ValueError, TypeError) as error:
        assert _named(str(error), call), (call.name, name, shape, str(error))
    else:
        results = result if isinstance(result, tuple) else (result,)
        assert all(isinstance(r, (torch.Tensor, F.QuantState, type(None))) for r in results)


@pytest.mark.parametrize("call", CALLS, ids=[call.name for call in CALLS])
def test_a_0d_tensor_argument_is_refused_naming_an_argument_or_computes(call):
    for name, valid in call.tensors.items():
        try:
            call(**{name: valid.reshape(-1)[0].clone()})
        except (ValueError, TypeError) as error:
            assert _named(str(error), call), (name, str(error))


def test_int8_linear_matmul_refuses_a_0d_B_naming_it():
    A = torch.ones(4, 8, dtype=torch.int8)
    for out in (None, torch.empty(4, 6, dtype=torch.int32)):
        with pytest.raises(ValueError, match="B must have at least one dimension"):
            F.int8_linear_matmul(A, torch.tensor(3, dtype=torch.int8), out=out)


@pytest.mark.parametrize(
    "bias", [torch.ones(15), torch.ones(3, 16), torch.tensor(1.0), torch.ones(16, dtype=torch.int64)]
)
def test_a_4bit_product_refuses_a_bias_of_another_shape(bias):
    """torch would broadcast a (3, 16) bias into a (3, 16) result for one row of A."""
    packed, state = F.quantize_4bit(torch.randn(16, 64), quant_type="nf4")
    for A in (torch.randn(1, 64), torch.randn(2, 64)):
        with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \(16,\)"):
            F.gemm_4bit(A, packed, state=state, bias=bias)
        with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \(16,\)"):
            tnb.matmul_4bit(A, packed.t(), state, bias=bias)
