"""Compact weights: blockwise 8-bit and 4-bit (NF4 / FP4) quantization, bit-compatible
with bitsandbytes, on tightfit's device-dispatched ops.

``tightfit.quant.functional`` mirrors ``bitsandbytes.functional``; ``QuantState``
serializes to the dict bitsandbytes and transformers write into safetensors;
``quantize_(model, config)`` swaps a model's ``nn.Linear`` layers for quantized ones;
``layer_stack(model)`` names a model's repeated layers, to choose which to keep at 8 bits;
``add_lora(model)`` freezes a model and puts trainable adapters beside its Linears (QLoRA).
``storage_formats()`` is the storage catalogue: one :class:`StorageFormat` per way of
storing a weight, which the fit planner, calibration and ``tightfit run`` iterate;
``register_format`` adds one.
"""

from tightfit._deprecation import renamed
from tightfit.quant import functional
from tightfit.quant.catalogue import (
    FLOAT8_DTYPE,
    StorageFormat,
    quantized_format,
    register_format,
    storage_format,
    storage_formats,
    unregister_format,
)
from tightfit.quant.config import (
    Blockwise8Config,
    FP4Config,
    Int8Config,
    NF4Config,
    QuantConfig,
    quantize_,
    register_handler,
)
from tightfit.quant.functional import COMPUTE_CHOICES
from tightfit.quant.layers import layer_stack
from tightfit.quant.lora import LoRALinear, add_lora
from tightfit.quant.modules import (
    Linear4bit,
    Linear8bit,
    LinearInt8,
    QuantizedLinear,
    move_unregistered,
    unregistered_tensors,
)
from tightfit.quant.state import QuantState

__all__ = [
    "COMPUTE_CHOICES",
    "FLOAT8_DTYPE",
    "Blockwise8Config",
    "FP4Config",
    "Int8Config",
    "Linear4bit",
    "Linear8bit",
    "LinearInt8",
    "LoRALinear",
    "NF4Config",
    "QuantConfig",
    "QuantState",
    "QuantizedLinear",
    "StorageFormat",
    "add_lora",
    "functional",
    "layer_stack",
    "move_unregistered",
    "quantize_",
    "quantized_format",
    "register_format",
    "register_handler",
    "storage_format",
    "storage_formats",
    "unregister_format",
    "unregistered_tensors",
]

__getattr__ = renamed(__name__, COMPUTE_4BIT=("COMPUTE_CHOICES", lambda: COMPUTE_CHOICES))
