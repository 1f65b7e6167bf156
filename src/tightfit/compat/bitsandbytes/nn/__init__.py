"""``bitsandbytes.nn`` on tightfit: ``import tightfit.compat.bitsandbytes.nn as nn`` (or
``from tightfit.compat.bitsandbytes.nn import Linear4bit``) in place of bitsandbytes'. As there,
the submodule :mod:`.parametrize` (4-bit storage for any parameter) is imported by name."""

from tightfit.compat.bitsandbytes._nn4bit import (
    Embedding4bit,
    EmbeddingFP4,
    EmbeddingNF4,
    Linear4bit,
    LinearFP4,
    LinearNF4,
    fix_4bit_weight_quant_state_from_module,
)
from tightfit.compat.bitsandbytes._nn8bit import (
    Embedding,
    Embedding8bit,
    Linear8bitLt,
    StableEmbedding,
)
from tightfit.compat.bitsandbytes._params import Int8Params, Params4bit

__all__ = [
    "Embedding",
    "Embedding4bit",
    "EmbeddingFP4",
    "EmbeddingNF4",
    "Embedding8bit",
    "Int8Params",
    "Linear4bit",
    "LinearFP4",
    "LinearNF4",
    "Linear8bitLt",
    "Params4bit",
    "StableEmbedding",
    "fix_4bit_weight_quant_state_from_module",
]
