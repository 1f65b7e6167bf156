"""Device-dispatched ops. Each is a ``torch.library`` custom op (``torch.ops.tightfit.*``)
with a pure-torch reference kernel that runs anywhere and fast kernels per device.

Public functions validate their arguments, then dispatch on the tensor's device.
Backend plugins add kernels with :func:`register_kernel`.
"""

from tightfit.ops._registry import Case, KernelInfo, OpDef, get_op, register_kernel, registered_ops
from tightfit.ops.cast import CAST_DTYPES, cast

__all__ = ["CAST_DTYPES", "Case", "KernelInfo", "OpDef", "cast", "get_op", "register_kernel", "registered_ops"]
