"""Device-dispatched ops. Each is a ``torch.library`` custom op (``torch.ops.tightfit.*``)
with a pure-torch reference kernel that runs anywhere and fast kernels per device.

Public functions validate their arguments, then dispatch on the tensor's device.
Backend plugins add kernels with :func:`register_kernel`.
"""

from tightfit.ops._autograd import int8_linear
from tightfit.ops._registry import Case, KernelInfo, OpDef, get_op, register_kernel, registered_ops
from tightfit.ops.blockwise import dequantize_4bit, dequantize_blockwise, quantize_4bit, quantize_blockwise
from tightfit.ops.blockwise_gemv import FEW_TOKENS, gemv_4bit, gemv_blockwise
from tightfit.ops.blockwise_gemv_int8 import gemv_4bit_int8, gemv_blockwise_int8
from tightfit.ops.cast import CAST_DTYPES, cast
from tightfit.ops.codes import code_4bit, dynamic_map
from tightfit.ops.float8_gemv import gemv_float8
from tightfit.ops.int8 import int8_linear_matmul, int8_mm_dequant, int8_vectorwise_dequant, int8_vectorwise_quant
from tightfit.ops.optimizer import optimizer_update_8bit_blockwise, optimizer_update_32bit

__all__ = [
    "CAST_DTYPES",
    "FEW_TOKENS",
    "Case",
    "KernelInfo",
    "OpDef",
    "cast",
    "code_4bit",
    "dequantize_4bit",
    "dequantize_blockwise",
    "dynamic_map",
    "gemv_4bit",
    "gemv_4bit_int8",
    "gemv_blockwise",
    "gemv_blockwise_int8",
    "gemv_float8",
    "get_op",
    "int8_linear",
    "int8_linear_matmul",
    "int8_mm_dequant",
    "int8_vectorwise_dequant",
    "int8_vectorwise_quant",
    "optimizer_update_32bit",
    "optimizer_update_8bit_blockwise",
    "quantize_4bit",
    "quantize_blockwise",
    "register_kernel",
    "registered_ops",
]
