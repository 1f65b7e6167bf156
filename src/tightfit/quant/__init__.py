"""Compact weights: blockwise 8-bit and 4-bit (NF4 / FP4) quantization, bit-compatible
with bitsandbytes, on tightfit's device-dispatched ops.

``tightfit.quant.functional`` mirrors ``bitsandbytes.functional``; ``QuantState``
serializes to the dict bitsandbytes and transformers write into safetensors;
``quantize_(model, config)`` swaps a model's ``nn.Linear`` layers for quantized ones;
``layer_stack(model)`` names a model's repeated layers, to choose which to keep at 8 bits.
"""

from tightfit.quant import functional
from tightfit.quant.config import Blockwise8Config, FP4Config, Int8Config, NF4Config, QuantConfig, quantize_, register_handler
from tightfit.quant.layers import layer_stack
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
    "layer_stack",
    "quantize_",
    "register_handler",
]
