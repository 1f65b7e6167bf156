"""Blockwise 8-bit and 4-bit quantization: bit-compatible with bitsandbytes both ways,
error bounds as bitsandbytes tests them, torch.library checks, and every bad input."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.ops import dequantize_4bit, dequantize_blockwise, dynamic_map, quantize_4bit, quantize_blockwise
from tightfit.ops.blockwise import BLOCKSIZES_4BIT, BLOCKSIZES_8BIT, FLOAT_DTYPES

bnb = pytest.importorskip("bitsandbytes")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

SHAPES = [(1,), (63,), (4096,), (4097,), (3, 1000), (17, 33, 5)]


def bnb_reference(op_name: str, *args):
    """bitsandbytes' pure-torch default kernel (its CPU kernel uses an approximate lookup)."""
    op = getattr(torch.ops.bitsandbytes, op_name).default
    return op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd), *args)


def sample(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * torch.rand(shape, generator=generator).exp()
    return values.to(dtype)


@pytest.mark.parametrize("blocksize", [64, 256, 4096, 8192, 1000, 1])  # bitsandbytes takes any blocksize for 8-bit
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_8bit_codes_and_absmax_match_bitsandbytes(shape, dtype, blocksize):
    A = sample(shape, dtype, seed=len(shape) * 7 + blocksize)
    q, absmax = quantize_blockwise(A, blocksize=blocksize)
    bnb_q, bnb_absmax = bnb_reference("quantize_blockwise", A, bnb_functional.create_dynamic_map(), blocksize)
    assert torch.equal(q, bnb_q) and torch.equal(absmax, bnb_absmax)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 4096])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_4bit_codes_and_absmax_match_bitsandbytes(shape, dtype, blocksize, quant_type):
    A = sample(shape, dtype, seed=len(shape) * 11 + blocksize)
    packed, absmax = quantize_4bit(A, blocksize=blocksize, quant_type=quant_type)
    bnb_packed, bnb_absmax = bnb_reference("quantize_4bit", A, blocksize, quant_type, torch.uint8)
    assert torch.equal(packed, bnb_packed) and torch.equal(absmax, bnb_absmax)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_bitsandbytes_decodes_ours_and_we_decode_theirs_8bit(dtype):
    A = sample((5, 4099), dtype, seed=3)
    q, absmax = quantize_blockwise(A, blocksize=1024)
    ours = dequantize_blockwise(q, absmax, blocksize=1024, dtype=dtype)
    assert torch.equal(
        bnb_reference("dequantize_blockwise", q, absmax, bnb_functional.create_dynamic_map(), 1024, dtype), ours
    )
    # bitsandbytes' native CPU kernel rounds half-precision outputs its own way on some
    # x86 hosts (seen on another machine): equal to within one rounding there.
    state = bnb_functional.QuantState(
        absmax=absmax, code=bnb_functional.create_dynamic_map(), blocksize=1024, dtype=dtype
    )
    torch.testing.assert_close(bnb_functional.dequantize_blockwise(q, state), ours, rtol=torch.finfo(dtype).eps, atol=0)
    their_q, their_state = bnb_functional.quantize_blockwise(A, blocksize=1024)  # their CPU kernel
    ours = dequantize_blockwise(their_q, their_state.absmax, their_state.code, 1024, dtype)
    torch.testing.assert_close(
        ours, bnb_functional.dequantize_blockwise(their_q, their_state), rtol=torch.finfo(dtype).eps, atol=0
    )


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_bitsandbytes_decodes_ours_and_we_decode_theirs_4bit(dtype, quant_type):
    A = sample((33, 65), dtype, seed=4)
    packed, absmax = quantize_4bit(A, blocksize=64, quant_type=quant_type)
    state = bnb_functional.QuantState(
        absmax=absmax,
        shape=A.shape,
        code=bnb_functional.get_4bit_type(quant_type, "cpu"),
        blocksize=64,
        quant_type=quant_type,
        dtype=dtype,
    )
    ours = dequantize_4bit(packed, absmax, 64, quant_type, list(A.shape), dtype)
    assert torch.equal(bnb_functional.dequantize_4bit(packed, state), ours)
    their_packed, their_state = bnb_functional.quantize_4bit(A, blocksize=64, quant_type=quant_type)
    assert torch.equal(
        dequantize_4bit(their_packed, their_state.absmax, 64, quant_type, list(A.shape), dtype),
        bnb_functional.dequantize_4bit(their_packed, their_state),
    )


def test_dynamic_map_is_bitsandbytes_map():
    import hashlib

    code = dynamic_map()
    assert hashlib.sha256(code.numpy().tobytes()).hexdigest() == tightfit.ops.codes.DYNAMIC_MAP_SHA256
    assert torch.equal(code, bnb_functional.create_dynamic_map())
    for quant_type in ("nf4", "fp4"):
        ours, theirs = tightfit.ops.code_4bit(quant_type), bnb_functional.get_4bit_type(quant_type, "cpu")
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_8bit_error_bounds_as_bitsandbytes_tests_them():
    A = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    q, absmax = quantize_blockwise(A)
    error = (dequantize_blockwise(q, absmax) - A).abs()
    assert error.mean() < 0.011
    assert (error / (A.abs() + 1e-8)).mean() < 0.018


def test_nf4_error_as_bitsandbytes_reports_it():
    A = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    packed, absmax = quantize_4bit(A, 64, "nf4")
    error = (dequantize_4bit(packed, absmax, 64, "nf4", [1024, 1024]) - A).abs().mean()
    assert 0.070 < float(error) < 0.076  # bitsandbytes: about 0.0728


def test_quant_storage_reinterprets_the_bytes():
    A = torch.randn(64, 64)
    as_bytes, absmax = quantize_4bit(A, 64, "nf4")
    as_bf16, _ = quantize_4bit(A, 64, "nf4", quant_storage=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16 and as_bf16.shape == (1024, 1)
    assert torch.equal(as_bf16.reshape(-1).view(torch.uint8), as_bytes.reshape(-1))
    assert torch.equal(
        dequantize_4bit(as_bf16, absmax, 64, "nf4", [64, 64]), dequantize_4bit(as_bytes, absmax, 64, "nf4", [64, 64])
    )


def test_odd_count_pads_with_a_scaled_zero():
    packed, absmax = quantize_4bit(torch.tensor([1.0, -1.0, 0.5]), 64, "nf4")
    assert packed.shape == (2, 1) and int(packed[1, 0]) & 15 == 7  # code 7 is NF4's zero


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("quantize_blockwise", lambda: (torch.randn(5000), dynamic_map(), 256)),
        (
            "dequantize_blockwise",
            lambda: (
                torch.randint(0, 256, (5000,), dtype=torch.uint8),
                torch.rand(20),
                dynamic_map(),
                256,
                torch.bfloat16,
            ),
        ),
        ("quantize_4bit", lambda: (torch.randn(33, 7).bfloat16(), 64, "fp4", torch.uint8)),
        (
            "dequantize_4bit",
            lambda: (
                torch.randint(0, 256, (116, 1), dtype=torch.uint8),
                torch.rand(4),
                64,
                "nf4",
                [33, 7],
                torch.float16,
            ),
        ),
        (
            "gemv_4bit",
            lambda: (
                torch.randn(1, 64),
                torch.randint(0, 256, (1536, 1), dtype=torch.uint8),
                [48, 64],
                torch.rand(48),
                64,
                "nf4",
            ),
        ),
        (
            "int8_linear_matmul",
            lambda: (
                torch.randint(-127, 128, (5, 64), dtype=torch.int8),
                torch.randint(-127, 128, (7, 64), dtype=torch.int8),
            ),
        ),
        (
            "int8_mm_dequant",
            lambda: (
                torch.randint(-1000, 1000, (5, 7), dtype=torch.int32),
                torch.rand(5),
                torch.rand(7),
                torch.bfloat16,
                torch.randn(7),
            ),
        ),
        ("int8_vectorwise_quant", lambda: (torch.randn(5, 64), 0.0)),
    ],
)
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.tightfit, op).default, args())


def test_quantize_under_torch_compile():
    def roundtrip(x):
        packed, absmax = quantize_4bit(x, 64, "nf4")
        return dequantize_4bit(packed, absmax, 64, "nf4", [256], torch.float32)

    x = torch.randn(256)
    assert torch.equal(torch.compile(roundtrip, backend="aot_eager")(x), roundtrip(x))


GOOD = torch.randn(128)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: quantize_blockwise([1.0]), TypeError, "A must be Tensor"),
        (
            lambda: quantize_blockwise(torch.ones(4, dtype=torch.int32)),
            ValueError,
            "A.dtype=torch.int32 is not accepted",
        ),
        (
            lambda: quantize_blockwise(GOOD, blocksize=0),
            ValueError,
            "blocksize=0 is not accepted; accepted: an int from 1",
        ),
        (lambda: quantize_blockwise(GOOD, blocksize=2**31), ValueError, "blocksize=2147483648 is not accepted"),
        (lambda: quantize_4bit(GOOD, blocksize=8192), ValueError, "blocksize=8192 is not accepted"),
        (lambda: quantize_blockwise(GOOD, blocksize=64.0), TypeError, "blocksize must be int"),
        (
            lambda: quantize_blockwise(GOOD, code=torch.zeros(16)),
            ValueError,
            "code must be a 1-D float32 tensor of 256",
        ),
        (lambda: quantize_blockwise(GOOD, code=dynamic_map().flip(0)), ValueError, "code must be sorted"),
        (lambda: quantize_blockwise(GOOD, code=dynamic_map().to("meta")), ValueError, "code is on meta"),
        (
            lambda: quantize_blockwise(torch.tensor([1.0, float("nan")])),
            ValueError,
            "NaN or inf values \\(first in block 0\\)",
        ),
        (
            lambda: quantize_blockwise(torch.cat([torch.ones(64), torch.tensor([float("inf")])]), blocksize=64),
            ValueError,
            "first in block 1",
        ),
        (lambda: dequantize_blockwise(torch.zeros(4), torch.ones(1)), TypeError, "A must be uint8"),
        (
            lambda: dequantize_blockwise(torch.zeros(100, dtype=torch.uint8), torch.ones(3), blocksize=64),
            ValueError,
            "need 2",
        ),
        (
            lambda: dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.ones(1, dtype=torch.int32)),
            TypeError,
            "absmax must be a floating-point",
        ),
        (
            lambda: dequantize_blockwise(torch.zeros(10, dtype=torch.uint8), torch.ones(1), dtype=torch.int8),
            ValueError,
            "dtype=torch.int8",
        ),
        (lambda: quantize_4bit(GOOD, blocksize=16), ValueError, "blocksize=16 is not accepted"),
        (lambda: quantize_4bit(GOOD, quant_type="int4"), ValueError, "quant_type='int4' is not accepted"),
        (lambda: quantize_4bit(torch.randn(6), quant_storage=torch.float32), ValueError, "cannot hold 3 packed bytes"),
        (lambda: quantize_4bit(torch.randn(4), quant_storage="uint8"), TypeError, "quant_storage must be dtype"),
        (lambda: quantize_4bit(torch.tensor([float("-inf"), 1.0])), ValueError, "NaN or inf"),
        (lambda: dequantize_4bit(torch.zeros(4, dtype=torch.uint8), torch.ones(1), shape=[9]), ValueError, "needs 5"),
        (
            lambda: dequantize_4bit(torch.zeros(4, dtype=torch.uint8), torch.ones(1), shape=None),
            TypeError,
            "shape must be a sequence",
        ),
        (
            lambda: dequantize_4bit(torch.zeros(4, dtype=torch.uint8), torch.ones(1), shape=[-8]),
            TypeError,
            "shape must be a sequence",
        ),
        (lambda: dequantize_4bit(torch.zeros(4, dtype=torch.uint8), torch.ones(2), shape=[8]), ValueError, "need 1"),
        (
            lambda: dequantize_4bit(torch.zeros(8, dtype=torch.uint8)[::2], torch.ones(1), shape=[8]),
            ValueError,
            "A must be contiguous",
        ),
        (
            lambda: dequantize_4bit(torch.zeros(4, dtype=torch.uint8), torch.ones(1), quant_type="nf5", shape=[8]),
            ValueError,
            "quant_type='nf5'",
        ),
    ],
)
def test_bad_inputs_are_rejected(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("blocksize", BLOCKSIZES_8BIT)
def test_every_8bit_blocksize_roundtrips(blocksize):
    A = torch.randn(3 * blocksize + 5)
    q, absmax = quantize_blockwise(A, blocksize=blocksize)
    assert (dequantize_blockwise(q, absmax, blocksize=blocksize) - A).abs().max() < 0.05 * A.abs().max()


@pytest.mark.parametrize("blocksize", [8192, 12289, 1000, 1])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_8bit_blocksizes_past_the_configs_decode_as_bitsandbytes_cpu_does(blocksize, dtype):
    A = sample((3, 8195), dtype, seed=blocksize)
    q, absmax = quantize_blockwise(A, blocksize=blocksize)
    theirs = torch.ops.bitsandbytes.dequantize_blockwise(
        q, absmax, bnb_functional.create_dynamic_map(), blocksize, dtype
    )
    assert absmax.shape == (-(-A.numel() // blocksize),)
    assert torch.equal(dequantize_blockwise(q, absmax, blocksize=blocksize, dtype=dtype), theirs)


@pytest.mark.parametrize("blocksize", BLOCKSIZES_4BIT)
def test_every_4bit_blocksize_matches_reference(blocksize):
    A = torch.randn(2 * blocksize + 3)
    packed, absmax = quantize_4bit(A, blocksize, "nf4")
    bnb_packed, bnb_absmax = bnb_reference("quantize_4bit", A, blocksize, "nf4", torch.uint8)
    assert torch.equal(packed, bnb_packed) and torch.equal(absmax, bnb_absmax)


def test_custom_code_with_crowded_entries_takes_the_scanning_path():
    crowded = 0.5 + torch.arange(56, dtype=torch.float32) * 1e-6  # many entries inside one search bucket
    code = torch.cat([torch.linspace(-1, 1, 200), crowded]).sort().values
    from tightfit.ops._cpu_blockwise import search_table

    assert search_table(code)[2] is False
    A = torch.cat([torch.randn(5000), 0.5 + torch.rand(3000) * 6e-5])
    A[0] = 1.0  # fix the scale of the first block
    q, absmax = quantize_blockwise(A, code=code, blocksize=4096)
    bnb_q, bnb_absmax = bnb_reference("quantize_blockwise", A, code, 4096)
    assert torch.equal(q, bnb_q) and torch.equal(absmax, bnb_absmax)
