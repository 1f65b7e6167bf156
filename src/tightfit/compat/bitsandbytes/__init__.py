"""``bitsandbytes`` on tightfit: ``import tightfit.compat.bitsandbytes as bnb`` in place of
``import bitsandbytes as bnb`` (and ``tightfit.compat.bitsandbytes.functional`` /
``.nn``, ``.optim`` for its submodules). The names, signatures and attributes are bitsandbytes'; every
kernel, module and hook behind them is tightfit's, dispatched on the tensor's device.
bitsandbytes' op schemas are ``torch.ops.tightfit_bitsandbytes.*`` (and ``torch.ops.bitsandbytes.*``
where bitsandbytes is not installed)."""

from tightfit.compat.bitsandbytes import functional, nn, optim, utils
from tightfit.compat.bitsandbytes._autograd8bit import MatmulLtState, matmul
from tightfit.compat.bitsandbytes._matmul4bit import matmul_4bit
from tightfit.compat.bitsandbytes._ops import defined_namespaces

__all__ = ["MatmulLtState", "functional", "matmul", "matmul_4bit", "nn", "optim", "utils"]

defined_namespaces()  # bitsandbytes' op schemas: torch.ops.tightfit_bitsandbytes (and .bitsandbytes without it)
