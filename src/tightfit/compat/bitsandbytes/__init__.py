"""``bitsandbytes`` on tightfit: ``import tightfit.compat.bitsandbytes as bnb`` in place of
``import bitsandbytes as bnb`` (and ``tightfit.compat.bitsandbytes.functional`` /
``.nn``, ``.optim`` for its submodules). The names, signatures and attributes are bitsandbytes'; every
kernel, module and hook behind them is tightfit's, dispatched on the tensor's device."""

from tightfit.compat.bitsandbytes import functional, nn, optim, utils
from tightfit.compat.bitsandbytes._autograd8bit import MatmulLtState, matmul
from tightfit.compat.bitsandbytes._matmul4bit import matmul_4bit

__all__ = ["MatmulLtState", "functional", "matmul", "matmul_4bit", "nn", "optim", "utils"]
