"""Optimizers with 8-bit blockwise state (bitsandbytes' format) or 32-bit state, on any
device: each step is one op call per parameter (:mod:`tightfit.ops.optimizer`), and the
state can be paged (kept in host memory, brought to the device per update). See docs/optim.md.
"""

from tightfit.optim.optimizer import BlockwiseOptimizer
from tightfit.optim.rules import LAMB, LARS, SGD, Adagrad, Adam, AdamW, AdEMAMix, Lion, RMSprop

__all__ = ["LAMB", "LARS", "SGD", "AdEMAMix", "Adagrad", "Adam", "AdamW", "BlockwiseOptimizer", "Lion", "RMSprop"]
