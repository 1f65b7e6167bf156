"""``bitsandbytes.nn`` on tightfit: ``import tightfit.compat.bitsandbytes.nn as nn`` (or
``from tightfit.compat.bitsandbytes.nn import Linear4bit``) in place of bitsandbytes'."""

from tightfit.compat.bitsandbytes._nn8bit import Embedding8bit, Int8Params, Linear8bitLt

__all__ = [
    "Embedding8bit",
    "Int8Params",
    "Linear8bitLt",
]
