"""bitsandbytes' op schemas on tightfit (``torch.ops.tightfit_bitsandbytes``): each op passes
``torch.library.opcheck`` and computes what tightfit's own op computes; where bitsandbytes
is not installed, ``torch.ops.bitsandbytes`` holds them too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tightfit.compat.bitsandbytes  # noqa: F401  (defines the namespace)
from tightfit.ops.codes import code_4bit, dynamic_map

ops = torch.ops.tightfit_bitsandbytes
opcheck = torch.library.opcheck


def weight4bit(quant_type: str = "nf4", blocksize: int = 64):
    torch.manual_seed(0)
    weight = torch.randn(64, 64)
    packed, absmax = ops.quantize_4bit(weight, blocksize, quant_type, torch.uint8)
    return weight, packed, absmax


def test_int8_ops_take_bitsandbytes_defaults():
    A = torch.randn(10, 20, dtype=torch.float16)
    A[1, 0] = 1000.0
    rows, stats, columns = ops.int8_vectorwise_quant(A)  # threshold defaults to 0: no outlier columns
    assert rows.dtype == torch.int8 and stats.shape == (10,) and columns is None
    assert ops.int8_vectorwise_quant(A, threshold=6.0)[2] is not None
    B = torch.randint(-128, 127, (30, 20), dtype=torch.int8)
    product = ops.int8_linear_matmul(rows, B)
    out = torch.empty_like(product)
    ops.int8_linear_matmul.out(rows, B, out)
    assert torch.equal(out, product)
    col_stats = torch.rand(30) * 3
    dequantized = ops.int8_mm_dequant(product, stats, col_stats)  # dtype defaults to float16
    assert dequantized.dtype == torch.float16
    assert torch.equal(ops.int8_scaled_mm(rows, B, stats, col_stats), dequantized)
    back = ops.int8_vectorwise_dequant(rows, stats)
    assert torch.allclose(back[2:], A[2:].float(), atol=0.05)
    for op, args in (
        (ops.int8_linear_matmul.default, (rows, B)),
        (ops.int8_linear_matmul.out, (rows, B, out)),
        (ops.int8_vectorwise_quant.default, (A, 6.0)),
        (ops.int8_mm_dequant.default, (product, stats, col_stats)),
        (ops.int8_scaled_mm.default, (rows, B, stats, col_stats, None, torch.bfloat16)),
    ):
        opcheck(op, args)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_ops_match_tightfit_s_and_pass_opcheck(quant_type):
    weight, packed, absmax = weight4bit(quant_type)
    decoded = ops.dequantize_4bit(packed, absmax, 64, quant_type, [64, 64], torch.float32)
    assert torch.equal(
        decoded, torch.ops.tightfit.dequantize_4bit(packed, absmax, 64, quant_type, [64, 64], torch.float32)
    )
    A = torch.randn(1, 64)
    table = code_4bit(quant_type)  # bitsandbytes passes the table, not its name
    expected = torch.ops.tightfit.gemv_4bit(A, packed, [64, 64], absmax, 64, quant_type)
    assert torch.equal(ops.gemv_4bit(A, packed, [64, 64], absmax, table, 64), expected)
    out = torch.empty(1, 64)
    ops.gemv_4bit.out(A, packed, [64, 64], absmax, table, 64, out)
    assert torch.equal(out, expected)
    many = torch.randn(2, 3, 64, requires_grad=True)
    product = ops.gemm_4bit(many, packed, [64, 64], absmax, 64, quant_type)
    assert torch.allclose(product, many @ decoded.T, atol=1e-5)
    product.sum().backward()  # autograd through the composite
    assert many.grad is not None
    for op, args in (
        (ops.quantize_4bit.default, (weight, 64, quant_type, torch.uint8)),
        (ops.dequantize_4bit.default, (packed, absmax, 64, quant_type, [64, 64], torch.float32)),
        (ops.dequantize_4bit.out, (packed, absmax, 64, quant_type, [64, 64], torch.float32, torch.empty(64, 64))),
        (ops.gemv_4bit.default, (A, packed, [64, 64], absmax, table, 64)),
        (ops.gemm_4bit.default, (many.detach(), packed, [64, 64], absmax, 64, quant_type)),
    ):
        opcheck(op, args)


def test_gemm_4bit_decodes_double_quantized_scales():
    _, packed, absmax = weight4bit()
    offset = absmax.mean()
    codes, nested = ops.quantize_blockwise(absmax - offset, dynamic_map(), 256)
    many = torch.randn(4, 64)
    exact = ops.gemm_4bit(many, packed, [64, 64], absmax, 64, "nf4")
    nested_product = ops.gemm_4bit(
        many, packed, [64, 64], nested, 64, "nf4", absmax_8bit=codes, absmax_code=dynamic_map(), absmax_offset=offset
    )
    assert torch.allclose(nested_product, exact, rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="absmax_8bit .* needs absmax_code and absmax_offset"):
        ops.gemm_4bit(many, packed, [64, 64], nested, 64, "nf4", absmax_8bit=codes)


def test_blockwise_ops_and_their_out_overload():
    A = torch.randn(1000)
    codes, absmax = ops.quantize_blockwise(A, dynamic_map(), 256)
    decoded = ops.dequantize_blockwise(codes, absmax, dynamic_map(), 256, torch.float32)
    out = torch.empty_like(decoded)
    ops.dequantize_blockwise.out(codes, absmax, dynamic_map(), 256, torch.float32, out)
    assert torch.equal(out, decoded)
    with pytest.raises(ValueError, match="out must be torch.float32 of shape \\(1000,\\)"):
        ops.dequantize_blockwise.out(codes, absmax, dynamic_map(), 256, torch.float32, torch.empty(999))
    opcheck(ops.quantize_blockwise.default, (A, dynamic_map(), 256))
    opcheck(ops.dequantize_blockwise.out, (codes, absmax, dynamic_map(), 256, torch.float32, out))


def test_a_table_that_is_no_4bit_code_is_refused():
    _, packed, absmax = weight4bit()
    with pytest.raises(ValueError, match="code must be the NF4 or FP4 table"):
        ops.gemv_4bit(torch.randn(1, 64), packed, [64, 64], absmax, torch.zeros(16), 64)


BLOCKED = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Block())
import torch
import tightfit.compat.bitsandbytes as bnb
A = torch.randn(1, 64)
packed, absmax = torch.ops.bitsandbytes.quantize_4bit(torch.randn(64, 64), 64, "nf4", torch.uint8)
print(bnb.defined_namespaces(), tuple(torch.ops.bitsandbytes.gemm_4bit(A, packed, [64, 64], absmax, 64, "nf4").shape))
"""


def test_without_bitsandbytes_its_own_namespace_holds_the_schemas():
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "('tightfit_bitsandbytes', 'bitsandbytes') (1, 64)" in done.stdout
