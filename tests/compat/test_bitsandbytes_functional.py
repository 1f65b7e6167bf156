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
from zoo.peer import PeerCheck

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


@pytest.mark.parametrize("K", [8, 1])
def test_int8_linear_matmul_is_the_exact_product_writes_out_and_refuses_other_dtypes(K):
    """The exact int32 product (the specification); bitsandbytes' too, where its CPU kernel
    gives it (on AVX-512 CPUs its ``torch._int_mm`` path is wrong at K = 1: a named xfail)."""
    generator = torch.Generator().manual_seed(0)
    A = torch.randint(-127, 128, (4, K), generator=generator, dtype=torch.int8)
    B = torch.randint(-127, 128, (3, K), generator=generator, dtype=torch.int8)
    exact = A.to(torch.int32) @ B.to(torch.int32).t()
    out = torch.empty(4, 3, dtype=torch.int32)
    assert TF.int8_linear_matmul(A, B, out=out) is out
    assert torch.equal(out, exact)
    with pytest.raises(ValueError, match="dtype=torch.float32 is not accepted"):
        TF.int8_linear_matmul(A, B, dtype=torch.float32)
    peer = PeerCheck()
    peer.agrees("bitsandbytes.functional.int8_linear_matmul", BF.int8_linear_matmul(A, B), exact)
    peer.settle()


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
    with pytest.raises(TypeError, match="state must be QuantState"):
        TF.gemv_4bit(x, q4.t())


def test_the_int8_functions_are_in_tightfit_quant_functional():
    for name in ("int8_vectorwise_quant", "int8_vectorwise_dequant", "int8_linear_matmul", "int8_mm_dequant"):
        assert name in QF.__all__ and name in TF.__all__


def test_every_name_is_bitsandbytes_or_one_of_its_ops():
    for name in TF.__all__:
        assert hasattr(BF, name) or hasattr(torch.ops.bitsandbytes, name), name


def quantized_weight(F, quant_type: str, nested: bool, dtype: torch.dtype):
    torch.manual_seed(1)
    W = torch.randn(48, 130, dtype=dtype)
    return F.quantize_4bit(W, blocksize=64, compress_statistics=nested, quant_type=quant_type)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemm_4bit_gives_bitsandbytes_product(quant_type, nested, dtype):
    import bitsandbytes

    packed, state = quantized_weight(TF, quant_type, nested, dtype)
    their_packed, their_state = quantized_weight(BF, quant_type, nested, dtype)
    assert torch.equal(packed, their_packed)
    x, bias = torch.randn(2, 5, 130, dtype=dtype), torch.randn(48, dtype=dtype)
    ours = TF.gemm_4bit(x, packed.t(), state=state, bias=bias)
    with torch.no_grad():  # bitsandbytes' matmul_4bit runs its gemm_4bit op
        theirs = bitsandbytes.matmul_4bit(x, their_packed.t(), quant_state=their_state, bias=bias)
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)
    # one row takes the decode kernel: another summation order, the same product to rounding
    exact = x[0, :1].double() @ TF.dequantize_4bit(packed, state).double().t()
    ulps = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1.3e-1}[dtype]  # results reach ~16
    torch.testing.assert_close(TF.gemm_4bit(x[0, :1], packed, state=state).double(), exact, rtol=0, atol=ulps)
    assert torch.equal(TF.gemm_4bit(x, packed, transposed_B=True, state=state, bias=bias), ours)


def test_gemm_4bit_refuses_what_it_cannot_honour():
    packed, state = quantized_weight(TF, "nf4", False, torch.float32)
    x = torch.randn(3, 130)
    with pytest.raises(ValueError, match="transposed_A=True is not supported"):
        TF.gemm_4bit(x, packed, transposed_A=True, state=state)
    with pytest.raises(TypeError, match="transposed_B must be bool"):
        TF.gemm_4bit(x, packed, transposed_B=1, state=state)
    with pytest.raises(TypeError, match="state must be QuantState"):
        TF.gemm_4bit(x, packed)
    with pytest.raises(ValueError, match="in_features, 130"):
        TF.gemm_4bit(torch.randn(3, 129), packed, state=state)


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_scaled_mm_gives_bitsandbytes_result(dtype, with_bias):
    torch.manual_seed(2)
    CA, SCA, _ = TF.int8_vectorwise_quant(torch.randn(7, 64))
    CB, SCB, _ = TF.int8_vectorwise_quant(torch.randn(24, 64))
    bias = torch.randn(24) if with_bias else None
    ours = TF.int8_scaled_mm(CA, CB, SCA, SCB, bias=bias, dtype=dtype)
    theirs = torch.ops.bitsandbytes.int8_scaled_mm(CA, CB, SCA, SCB, bias=bias, dtype=dtype)
    assert ours.dtype == theirs.dtype == (dtype or torch.float16) and torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("rows", "threshold"),
    [(4, 0.0), (4, 50.0), (4, 1.5), (1, 1.5), (4, 1e-6)],
    ids=["threshold 0", "no outliers", "outliers", "one row", "all outliers"],
)
def test_outlier_columns_are_bitsandbytes(rows, threshold):
    torch.manual_seed(3)
    A = torch.randn(rows, 32, dtype=torch.float16)
    ours, theirs = TF.int8_vectorwise_quant(A, threshold), BF.int8_vectorwise_quant(A.clone(), threshold)
    if theirs[2] is None:
        assert ours[2] is None
    else:
        assert ours[2].dtype == theirs[2].dtype == torch.int64 and torch.equal(ours[2], theirs[2])
    if 0 < threshold < 1:  # every value is an outlier: bitsandbytes divides 0 by 0 for the row scales
        assert torch.equal(ours[0], torch.zeros_like(ours[0])) and torch.equal(ours[1], torch.zeros(rows))
        return
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_get_4bit_type_is_bitsandbytes():
    for name in ("nf4", "fp4"):
        assert torch.equal(bits(TF.get_4bit_type(name)), bits(BF.get_4bit_type(name, device="cpu")))
    with pytest.raises(ValueError, match="typename"):
        TF.get_4bit_type("af4")


def test_dequantize_4bit_of_the_transposed_row_is_transposed_as_in_bitsandbytes():
    packed, state = quantized_weight(TF, "nf4", False, torch.float32)
    ours, theirs = TF.dequantize_4bit(packed.t(), state), BF.dequantize_4bit(packed.t(), state)
    assert ours.shape == theirs.shape == (130, 48) and torch.equal(ours, theirs)


def out_calls():
    """(name, call writing into ``out``, the expected result, a right-sized ``out``) per function with ``out=``."""
    torch.manual_seed(4)
    W = torch.randn(48, 130)
    packed, state = TF.quantize_4bit(W, quant_type="nf4")
    q8, s8 = TF.quantize_blockwise(W, blocksize=256)
    CA, SCA, _ = TF.int8_vectorwise_quant(torch.randn(5, 130))
    CB, SCB, _ = TF.int8_vectorwise_quant(W)
    product = TF.int8_linear_matmul(CA, CB)
    x = torch.randn(3, 130)
    return [
        ("quantize_blockwise", lambda out: TF.quantize_blockwise(W, out=out, blocksize=256)[0], q8),
        (
            "quantize_blockwise absmax",
            lambda out: TF.quantize_blockwise(W, absmax=out, blocksize=256)[1].absmax,
            s8.absmax,
        ),
        ("dequantize_blockwise", lambda out: TF.dequantize_blockwise(q8, s8, out=out), TF.dequantize_blockwise(q8, s8)),
        ("quantize_4bit", lambda out: TF.quantize_4bit(W, out=out, quant_type="nf4")[0], packed),
        ("quantize_4bit absmax", lambda out: TF.quantize_4bit(W, absmax=out, quant_type="nf4")[1].absmax, state.absmax),
        ("dequantize_4bit", lambda out: TF.dequantize_4bit(packed, state, out=out), TF.dequantize_4bit(packed, state)),
        (
            "gemv_4bit",
            lambda out: TF.gemv_4bit(x[:1], packed.t(), out=out, state=state),
            TF.gemv_4bit(x[:1], packed, state=state),
        ),
        ("gemm_4bit", lambda out: TF.gemm_4bit(x, packed, out=out, state=state), TF.gemm_4bit(x, packed, state=state)),
        ("int8_linear_matmul", lambda out: TF.int8_linear_matmul(CA, CB, out=out), product),
        (
            "int8_mm_dequant",
            lambda out: TF.int8_mm_dequant(product, SCA, SCB, out=out),
            TF.int8_mm_dequant(product, SCA, SCB),
        ),
    ]


@pytest.mark.parametrize("index", range(10), ids=[call[0] for call in out_calls()])
def test_out_is_written_whole_or_refused_untouched(index):
    name, call, expected = out_calls()[index]
    out = torch.full_like(expected, 7)
    assert call(out) is out and torch.equal(out, expected), name
    wrong_dtype = torch.float64 if expected.dtype != torch.float64 else torch.float32
    for bad in (
        torch.full((expected.numel() + 1,), 7, dtype=expected.dtype),
        torch.full_like(expected, 7, dtype=wrong_dtype),
        torch.empty_like(expected, device="meta"),
    ):
        before = bad.clone() if bad.device.type != "meta" else None
        with pytest.raises(ValueError, match="out|absmax|dtype"):
            call(bad)
        assert before is None or torch.equal(bad, before), name


def test_4bit_blocksizes_past_4096_are_refused_as_in_bitsandbytes():
    W = torch.randn(64, 256)
    with pytest.raises(ValueError, match="invalid blocksize 8192"):
        BF.quantize_4bit(W, blocksize=8192)
    with pytest.raises(ValueError, match="blocksize=8192 is not accepted"):
        TF.quantize_4bit(W, blocksize=8192)


@pytest.mark.parametrize("blocksize", [8192, 1000])
def test_8bit_blocksizes_past_4096_round_trip_as_in_bitsandbytes(blocksize):
    A = torch.randn(20_000, generator=torch.Generator().manual_seed(5))
    q, state = TF.quantize_blockwise(A, blocksize=blocksize)
    expected_q, expected_state = BF.quantize_blockwise(A, blocksize=blocksize)
    assert state.blocksize == blocksize
    assert torch.equal(state.absmax, expected_state.absmax)
    off = (q.int() - expected_q.int()).abs()  # its CPU kernel's approximate code lookup, as at 4096 and below
    assert off.max() <= 1 and off.float().mean() < 0.01
    assert torch.equal(TF.dequantize_blockwise(q, state), BF.dequantize_blockwise(q, expected_state))
