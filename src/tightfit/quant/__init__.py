"""Compact weights: blockwise 8-bit and 4-bit (NF4 / FP4) quantization, bit-compatible
with bitsandbytes, on tightfit's device-dispatched ops.

``tightfit.quant.functional`` mirrors ``bitsandbytes.functional``; ``QuantState``
serializes to the dict bitsandbytes and transformers write into safetensors.
"""

from tightfit.quant import functional
from tightfit.quant.state import QuantState

__all__ = ["QuantState", "functional"]
