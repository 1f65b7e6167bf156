"""Code written against ``bitsandbytes.functional``, run with bitsandbytes' module and
with ``tightfit.compat.bitsandbytes.functional`` swapped in: the results agree bit for
bit where the format fixes them."""

from __future__ import annotations

import hashlib

import pytest
import torch

import tightfit.compat.bitsandbytes.functional as TF
import tightfit.quant.functional as QF
from tightfit import ops
from tightfit.ops.codes import DYNAMIC_MAP_SHA256

pytest.importorskip("bitsandbytes")
BF = pytest.importorskip("bitsandbytes.functional")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns, so -0.0 and +0.0 differ and equal NaNs match."""
    return tensor.contiguous().view(torch.int32)


MAPS = [
    ("create_dynamic_map", {}),
    ("create_dynamic_map", {"signed": False}),
    ("create_dynamic_map", {"max_exponent_bits": 4}),
    ("create_dynamic_map", {"max_exponent_bits": 3, "total_bits": 5}),
    ("create_dynamic_map", {"signed": False, "max_exponent_bits": 3, "total_bits": 4}),
    ("create_linear_map", {}),
    ("create_linear_map", {"signed": False}),
    ("create_linear_map", {"add_zero": False}),
    ("create_linear_map", {"total_bits": 4}),
    ("create_linear_map", {"signed": False, "total_bits": 3, "add_zero": False}),
    ("create_normal_map", {}),
    ("create_normal_map", {"use_extra_value": False}),
    ("create_normal_map", {"offset": 0.99}),
    ("create_fp8_map", {}),
    ("create_fp8_map", {"exponent_bits": 4, "precision_bits": 3}),
    ("create_fp8_map", {"exponent_bits": 2, "precision_bits": 1, "total_bits": 4}),
    ("create_fp8_map", {"signed": False, "exponent_bits": 4, "precision_bits": 4}),
    ("create_fp8_map", {"signed": False, "exponent_bits": 3, "precision_bits": 3, "total_bits": 6}),
]


@pytest.mark.parametrize(("name", "kwargs"), MAPS, ids=[f"{n}-{k}" for n, k in MAPS])
def test_code_maps_are_bit_equal(name, kwargs):
    if name == "create_normal_map":
        pytest.importorskip("scipy")  # bitsandbytes needs it for this map; tightfit does not
    theirs = getattr(BF, name)(**kwargs)
    ours = getattr(TF, name)(**kwargs)
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape == (256,)
    assert torch.equal(bits(ours), bits(theirs))


def test_the_default_dynamic_map_is_the_one_blockwise_quantization_uses():
    ours = TF.create_dynamic_map()
    assert torch.equal(ours, ops.dynamic_map())
    assert hashlib.sha256(ours.numpy().tobytes()).hexdigest() == DYNAMIC_MAP_SHA256


def test_the_normal_map_holds_nf4():
    values = TF.create_normal_map()
    assert torch.equal(values[values != 0], ops.code_4bit("nf4")[ops.code_4bit("nf4") != 0])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: TF.create_fp8_map(exponent_bits=4, precision_bits=2), ValueError, "total_bits - 1"),
        (lambda: TF.create_fp8_map(total_bits=9), ValueError, "total_bits=9"),
        (lambda: TF.create_dynamic_map(max_exponent_bits=8), ValueError, "max_exponent_bits=8"),
        (lambda: TF.create_dynamic_map(signed=False, max_exponent_bits=5), ValueError, "give 253 values"),
        (lambda: TF.create_dynamic_map(total_bits=8.0), TypeError, "total_bits must be int"),
        (lambda: TF.create_linear_map(signed="yes"), TypeError, "signed must be bool"),
        (lambda: TF.create_normal_map(offset=1.0), ValueError, "offset=1.0"),
    ],
)
def test_bad_map_arguments_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def llm_int8(F, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, threshold: float):
    """LLM.int8() as bitsandbytes' docs and tests write it with ``F``'s functions."""
    CB, SCB, _ = F.int8_vectorwise_quant(weight)
    CA, SCA, outlier_cols = F.int8_vectorwise_quant(x, threshold=threshold)
    product = F.int8_linear_matmul(CA, CB)
    out = F.int8_mm_dequant(product, SCA, SCB, bias=bias)
    restored = F.int8_vectorwise_dequant(CB, SCB)
    return CB, SCB, CA, SCA, outlier_cols, product, out, restored


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threshold", [0.0, 2.5, 100.0])
def test_llm_int8_code_gives_bitsandbytes_results(dtype, threshold):
    torch.manual_seed(0)
    x = torch.randn(6, 40, dtype=dtype)
    weight = torch.randn(24, 40, dtype=dtype)
    bias = torch.randn(24, dtype=torch.float16)
    *theirs, their_restored = llm_int8(BF, x.clone(), weight.clone(), bias, threshold)
    *ours, restored = llm_int8(TF, x.clone(), weight.clone(), bias, threshold)
    # bitsandbytes computes A * stats * float32(1/127), tightfit A * (stats / 127): one ulp apart at most
    torch.testing.assert_close(restored, their_restored, rtol=2.4e-7, atol=0)
    for a, b in zip(ours, theirs):
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_int8_mm_dequant_takes_a_dtype_or_out():
    torch.manual_seed(0)
    product = torch.randint(-5000, 5000, (3, 5), dtype=torch.int32)
    row, col = torch.rand(3) + 0.5, torch.rand(5) + 0.5
    assert TF.int8_mm_dequant(product, row, col).dtype == torch.float16
    as_float = TF.int8_mm_dequant(product, row, col, dtype=torch.float32)
    assert as_float.dtype == torch.float32
    torch.testing.assert_close(as_float, product.float() * row[:, None] * col / 127**2)
    out = torch.empty(3, 5, dtype=torch.bfloat16)
    assert TF.int8_mm_dequant(product, row, col, out) is out
    assert torch.equal(out, TF.int8_mm_dequant(product, row, col, dtype=torch.bfloat16))


def test_int8_linear_matmul_writes_out_and_refuses_other_dtypes():
    A = torch.randint(-127, 128, (4, 8), dtype=torch.int8)
    B = torch.randint(-127, 128, (3, 8), dtype=torch.int8)
    out = torch.empty(4, 3, dtype=torch.int32)
    assert TF.int8_linear_matmul(A, B, out=out) is out
    assert torch.equal(out, BF.int8_linear_matmul(A, B))
    with pytest.raises(ValueError, match="dtype=torch.float32 is not accepted"):
        TF.int8_linear_matmul(A, B, dtype=torch.float32)


def blockwise_and_4bit(F, W: torch.Tensor):
    """Quantization as bitsandbytes' users call it, keyword for keyword."""
    q8, s8 = F.quantize_blockwise(W, blocksize=256)
    q8n, s8n = F.quantize_blockwise(W, blocksize=256, nested=True)
    q4, s4 = F.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")
    q4f, s4f = F.quantize_4bit(W, blocksize=128, quant_type="fp4", quant_storage=torch.bfloat16)
    return (q8, s8), (q8n, s8n), (q4, s4), (q4f, s4f)


def test_blockwise_and_4bit_code_gives_bitsandbytes_codes():
    torch.manual_seed(0)
    W = torch.randn(32, 96)
    (q8, s8), (q8n, s8n), (q4, s4), (q4f, s4f) = blockwise_and_4bit(TF, W)
    (b8, t8), (b8n, t8n), (b4, t4), (b4f, t4f) = blockwise_and_4bit(BF, W)
    for ours, theirs in (
        (q4, b4),
        (s4.absmax, t4.absmax),
        (s4.offset, t4.offset),
        (q4f, b4f),
        (s4f.absmax, t4f.absmax),
    ):
        assert ours.dtype == theirs.dtype and torch.equal(bits(ours.float()), bits(theirs.float()))
    assert torch.equal(s8.absmax, t8.absmax) and torch.equal(s8n.offset, t8n.offset)
    # bitsandbytes' CPU 8-bit kernel looks codes up approximately (see docs/quantization.md):
    # a few codes are its reference's neighbours; tightfit gives the reference's
    for ours, theirs in ((q8, b8), (q8n, b8n), (s8n.absmax, t8n.absmax)):
        off = (ours.int() - theirs.int()).abs()
        assert off.max() <= 1 and off.float().mean() < 0.01
    torch.testing.assert_close(TF.dequantize_blockwise(q8, s8), BF.dequantize_blockwise(q8, s8))
    torch.testing.assert_close(TF.dequantize_4bit(q4, s4), W, atol=0.5, rtol=0)
    x = torch.randn(1, 96)
    torch.testing.assert_close(TF.gemv_4bit(x, q4.t(), state=s4), x @ TF.dequantize_4bit(q4, s4).t())
    with pytest.raises((TypeError, ValueError), match="quant_state"):
        TF.gemv_4bit(x, q4.t())


def test_the_int8_functions_are_in_tightfit_quant_functional():
    for name in ("int8_vectorwise_quant", "int8_vectorwise_dequant", "int8_linear_matmul", "int8_mm_dequant"):
        assert name in QF.__all__ and getattr(TF, name) is getattr(QF, name)
