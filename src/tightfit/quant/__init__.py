"""Compact weights: blockwise 8-bit and 4-bit (NF4 / FP4) quantization, bit-compatible
with bitsandbytes, on tightfit's device-dispatched ops.

``tightfit.quant.functional`` mirrors ``bitsandbytes.functional``; ``QuantState``
serializes to the dict bitsandbytes and transformers write into safetensors;
``quantize_(model, config)`` swaps a model's ``nn.Linear`` layers for quantized ones.
"""

from tightfit.quant import functional
from tightfit.quant.config import Blockwise8Config, FP4Config, Int8Config, NF4Config, QuantConfig, quantize_, register_handler
from tightfit.quant.modules import Linear4bit, Linear8bit, LinearInt8, QuantizedLinear
from tightfit.quant.state import QuantState

__all__ = [
    "Blockwise8Config",
    "FP4Config",
    "Int8Config",
    "Linear4bit",
    "Linear8bit",
    "LinearInt8",
    "NF4Config",
    "QuantConfig",
    "QuantState",
    "QuantizedLinear",
    "functional",
    "quantize_",
    "register_handler",
]
