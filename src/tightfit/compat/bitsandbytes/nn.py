"""``bitsandbytes.nn`` on tightfit: ``import tightfit.compat.bitsandbytes.nn as nn`` (or
``from tightfit.compat.bitsandbytes.nn import Linear4bit``) in place of bitsandbytes'."""

from tightfit.compat.bitsandbytes._nn4bit import (
    Embedding4bit,
    EmbeddingFP4,
    EmbeddingNF4,
    Linear4bit,
    LinearFP4,
    LinearNF4,
    Params4bit,
    fix_4bit_weight_quant_state_from_module,
)

__all__ = [
    "Embedding4bit",
    "EmbeddingFP4",
    "EmbeddingNF4",
    "Linear4bit",
    "LinearFP4",
    "LinearNF4",
    "Params4bit",
    "fix_4bit_weight_quant_state_from_module",
]
