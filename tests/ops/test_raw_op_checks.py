"""Regression tests for the raw ops' own checks (D9): the calls that once read or wrote out
of bounds, hung or returned heap bytes now raise a clean error on every path, before any
kernel runs: torch.ops.tightfit.*, the direct path get_op(name)(...), and tracing."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.ops import dynamic_map, get_op
from tightfit.ops.blockwise import _quantize_4bit_reference, _quantize_blockwise_reference

PATHS = {"torch.ops": lambda name: getattr(torch.ops.tightfit, name), "direct": get_op}

W = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
PACKED, ABSMAX = _quantize_4bit_reference(W, 64, "nf4", torch.uint8)
CODES, ABSMAX8 = _quantize_blockwise_reference(W, dynamic_map(), 64)
QABSMAX8 = ABSMAX8.to(torch.uint8)  # double-quantized scales' codes: one a block
W8 = W.to(torch.float8_e4m3fn)

BAD_CALLS = [
    # an 8-byte input decoded as a large shape read the heap
    ("dequantize_4bit", (PACKED[:8], ABSMAX, 64, "nf4", [1000, 1000], torch.float32), ValueError, "packed bytes"),
    ("dequantize_4bit", (PACKED, ABSMAX[:0], 64, "nf4", [8, 16], torch.float32), ValueError, "absmax has shape"),
    (
        "dequantize_4bit",
        (PACKED.reshape(2, -1).t(), ABSMAX, 64, "nf4", [8, 16], torch.float32),
        ValueError,
        "contiguous",
    ),
    ("dequantize_4bit", (PACKED, ABSMAX, 64, "nf4", [-8, -16], torch.float32), TypeError, "non-negative"),
    # blocksize 0 looped forever holding the kernel lock
    ("gemv_4bit", (torch.randn(1, 16), PACKED, [8, 16], ABSMAX, 0, "nf4"), ValueError, "blocksize"),
    ("gemv_4bit", (torch.randn(1, 16), PACKED[:10], [8, 16], ABSMAX, 64, "nf4"), ValueError, "packed bytes"),
    ("gemv_4bit", (torch.randn(1, 15), PACKED, [8, 16], ABSMAX, 64, "nf4"), ValueError, "in_features"),
    ("gemv_4bit_int8", (torch.randn(1, 16), PACKED, [8, 16], ABSMAX, 0, "nf4"), ValueError, "blocksize"),
    ("gemv_4bit_int8", (torch.randn(1, 16), PACKED[:10], [8, 16], ABSMAX, 64, "nf4"), ValueError, "packed bytes"),
    ("gemv_4bit_int8", (torch.randn(1, 15), PACKED, [8, 16], ABSMAX, 64, "nf4"), ValueError, "in_features"),
    ("gemv_4bit_int8", (torch.randn(1, 16), PACKED, [8, 16], ABSMAX[:0], 64, "nf4"), ValueError, "absmax"),
    (
        "dequantize_blockwise",
        (torch.zeros(100, dtype=torch.uint8), torch.ones(2), dynamic_map()[:16], 64, torch.float32),
        ValueError,
        "256 values",
    ),
    (
        "dequantize_blockwise",
        (torch.zeros(100, dtype=torch.uint8), torch.ones(1), dynamic_map(), 64, torch.float32),
        ValueError,
        "need 2",
    ),
    ("quantize_blockwise", (torch.randn(100), dynamic_map().flip(0), 64), ValueError, "sorted"),
    ("quantize_blockwise", (torch.randn(100).to(torch.int32), dynamic_map(), 64), ValueError, "A.dtype"),
    ("quantize_4bit", (torch.randn(6), 64, "nf4", torch.float32), ValueError, "quant_storage"),
    ("quantize_4bit", (torch.randn(6), 64, "nf5", torch.uint8), ValueError, "quant_type"),
    (
        "int8_linear_matmul",
        (torch.zeros(2, 3, dtype=torch.int8), torch.zeros(4, 5, dtype=torch.int8)),
        ValueError,
        "shapes",
    ),
    (
        "int8_mm_dequant",
        (torch.zeros(2, 3, dtype=torch.int32), torch.ones(3), torch.ones(3), torch.float32, None),
        ValueError,
        "row_stats",
    ),
    ("cast_into", (torch.randn(4), torch.empty(5, dtype=torch.bfloat16)), ValueError, "out has shape"),
    # gemv_blockwise: the native kernel reads B, absmax and the tables by the sizes the op derives
    ("gemv_blockwise", (torch.randn(1, 16), CODES.t(), ABSMAX8, dynamic_map(), 64), ValueError, "contiguous"),
    ("gemv_blockwise", (torch.randn(1, 16), CODES.view(torch.int8), ABSMAX8, dynamic_map(), 64), TypeError, "uint8"),
    ("gemv_blockwise", (torch.randn(1, 16), CODES.reshape(-1), ABSMAX8, dynamic_map(), 64), TypeError, "2-D"),
    ("gemv_blockwise", (torch.randn(1, 15), CODES, ABSMAX8, dynamic_map(), 64), ValueError, "in_features"),
    ("gemv_blockwise", (torch.randn(1, 16), CODES, ABSMAX8[:1], dynamic_map(), 64), ValueError, "absmax has shape"),
    ("gemv_blockwise", (torch.randn(1, 16), CODES, ABSMAX8, dynamic_map()[:16], 64), ValueError, "256 values"),
    ("gemv_blockwise", (torch.randn(1, 16), CODES, ABSMAX8, dynamic_map(), 0), ValueError, "blocksize"),
    ("gemv_blockwise", (torch.randn(1, 16), CODES, ABSMAX8, dynamic_map(), 1 << 62), ValueError, "blocksize"),
    (
        "gemv_blockwise",
        (torch.randn(1, 16), CODES, QABSMAX8, dynamic_map(), 64, torch.ones(5), dynamic_map(), 1),
        ValueError,
        "absmax2 must be",
    ),
    (
        "gemv_blockwise",
        (torch.randn(1, 16), CODES, QABSMAX8, dynamic_map(), 64, torch.ones(2), dynamic_map(), 1 << 40),
        ValueError,
        "blocksize",
    ),
    (
        "gemv_blockwise",
        (torch.randn(1, 16), CODES, ABSMAX8, dynamic_map(), 64, None, dynamic_map()),
        ValueError,
        "code2 or offset is given without absmax2",
    ),
    (
        "gemv_blockwise",
        (torch.randn(1, 16), CODES, QABSMAX8, dynamic_map(), 64, torch.ones(2), dynamic_map(), 1, torch.ones(2)),
        ValueError,
        "offset must be a float32 tensor of one value",
    ),
    # gemv_float8: the native kernel reads the weight as rows of in_features bytes, the scale per row
    ("gemv_float8", (torch.randn(1, 8), W8.t(), None, None), ValueError, "contiguous 2-D"),
    ("gemv_float8", (torch.randn(1, 16), W8.view(torch.uint8), None, None), TypeError, "float8_e4m3fn or"),
    ("gemv_float8", (torch.randn(1, 16), W8.reshape(-1), None, None), ValueError, "contiguous 2-D"),
    ("gemv_float8", (torch.randn(1, 15), W8, None, None), ValueError, "in_features"),
    ("gemv_float8", (torch.randn(1, 16), W8, torch.ones(8), None), ValueError, "scale must hold"),
    ("gemv_float8", (torch.randn(1, 16), W8, torch.ones(9, 1), None), ValueError, "scale must hold"),
    ("gemv_float8", (torch.randn(1, 16), W8, torch.ones(8, 1, dtype=torch.int64), None), TypeError, "scale must be"),
    ("gemv_float8", (torch.randn(1, 16), W8, None, torch.ones(4)), ValueError, "bias must be"),
    ("gemv_float8", (torch.randn(1, 16), W8, None, torch.ones(8, dtype=torch.float16)), ValueError, "bias must be"),
]
# gemv_blockwise_int8 takes gemv_blockwise's arguments and check: the same bad calls
BAD_CALLS += [("gemv_blockwise_int8", *rest) for name, *rest in BAD_CALLS if name == "gemv_blockwise"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("name", "args", "error", "match"), BAD_CALLS, ids=[f"{c[0]}-{c[3]}" for c in BAD_CALLS])
def test_raw_op_refuses_unsafe_arguments(path, name, args, error, match):
    with pytest.raises(error, match=match):
        PATHS[path](name)(*args)


HUGE_ROWS = 1 << 40  # rows of an expanded input: nothing may be sized by them before a clean error


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("gemv_float8", (torch.randn(1, 16).expand(HUGE_ROWS, 16), W8, None, None)),
        ("gemv_blockwise", (torch.randn(1, 16).expand(HUGE_ROWS, 16), CODES, ABSMAX8, dynamic_map(), 64)),
        ("gemv_4bit", (torch.randn(1, 16).expand(HUGE_ROWS, 16), PACKED, [8, 16], ABSMAX, 64, "nf4")),
        ("int8_linear_matmul", (torch.ones(1, 16, dtype=torch.int8).expand(HUGE_ROWS, 16), W.to(torch.int8))),
    ],
    ids=["gemv_float8", "gemv_blockwise", "gemv_4bit", "int8_linear_matmul"],
)
def test_outputs_too_large_to_allocate_raise_cleanly(path, name, args):
    """An input of 2**40 rows (a stride-0 view, so it costs nothing) asks for an output no
    allocator gives: a clean error, never a crash or a write past a smaller buffer."""
    with pytest.raises((ValueError, TypeError, RuntimeError)):
        PATHS[path](name)(*args)


def test_a_traced_call_is_refused_by_the_fake_kernel_check():
    def decode(packed, absmax):
        return torch.ops.tightfit.dequantize_4bit(packed, absmax, 64, "nf4", [1000, 1000], torch.float32)

    with pytest.raises(Exception, match="packed bytes"):  # dynamo wraps what the fake kernel raised
        torch.compile(decode, backend="eager", fullgraph=True)(PACKED[:8], ABSMAX)


@pytest.mark.parametrize("path", PATHS)
def test_raw_quantize_of_nan_and_inf_codes_as_the_reference_does(path):
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    x[5], x[100], x[-1] = float("nan"), float("inf"), -float("nan")
    q, absmax = PATHS[path]("quantize_blockwise")(x, dynamic_map(), 64)
    q_ref, absmax_ref = _quantize_blockwise_reference(x, dynamic_map(), 64)
    assert torch.equal(q, q_ref) and torch.equal(absmax.nan_to_num(), absmax_ref.nan_to_num())
    packed, _ = PATHS[path]("quantize_4bit")(x, 64, "fp4", torch.uint8)
    assert torch.equal(packed, _quantize_4bit_reference(x, 64, "fp4", torch.uint8)[0])
    with pytest.raises(ValueError, match="NaN or inf"):  # the public function still refuses them
        tightfit.ops.quantize_4bit(x)


def test_int8_edges_that_once_raised_unclean_errors():
    q, stats, cols = tightfit.ops.int8_vectorwise_quant(torch.zeros(3, 0))  # zero-width rows are valid
    assert q.shape == (3, 0) and stats.shape == (3,) and cols is None
    _, _, cols = tightfit.ops.int8_vectorwise_quant(torch.randn(3, 4), 10**400)  # past float's range: no outliers
    assert cols.numel() == 0
    for call in (
        lambda: tightfit.ops.int8_vectorwise_dequant(torch.zeros((), dtype=torch.int8), torch.ones(1)),
        lambda: tightfit.ops.int8_mm_dequant(torch.zeros((), dtype=torch.int32), torch.ones(1), torch.ones(1)),
    ):
        with pytest.raises(ValueError, match="scalar"):
            call()
