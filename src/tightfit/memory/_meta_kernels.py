"""Meta kernels that stand in for PyTorch's own while tightfit traces a model on fake
tensors (the planner's memory plan), where PyTorch's meta kernel refuses what its real
kernels compute; removed when the trace ends.

``aten::_grouped_mm``: transformers' mixture-of-experts layers (Mixtral, Qwen-MoE) run
their experts as one grouped matmul. Its meta kernel accepts bfloat16 only, while the CPU
kernel computes float32 as well, so a float32 MoE model ran but could not be planned.
The stand-in gives the output the real kernel gives (shape and dtype), with the checks
the shapes need; the real call still checks everything else.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["lenient_meta_kernels"]


def _grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of ``torch._grouped_mm(mat_a, mat_b, offs)``: 2D x 3D (the experts'
    weights, rows grouped by ``offs``) gives rows x out; 3D x 2D and 2D x 2D group the
    other operand; 3D x 3D is a batched matmul."""
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm takes 2D or 3D operands")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        torch._check(offs is not None, lambda: "grouped_mm of two 2D operands needs offs")
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif mat_a.dim() == 2:
        torch._check(mat_a.shape[1] == mat_b.shape[1], lambda: "grouped_mm: the inner dimensions differ")
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif mat_b.dim() == 2:
        shape = (mat_a.shape[1], mat_b.shape[1])
    else:
        torch._check(mat_a.shape[2] == mat_b.shape[1], lambda: "grouped_mm: the inner dimensions differ")
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


@contextmanager
def lenient_meta_kernels() -> Iterator[None]:
    """Within: the stand-in meta kernels above replace PyTorch's (process-wide, as any
    dispatcher registration is); on leaving, PyTorch's own are back."""
    library = torch.library.Library("aten", "IMPL")
    try:
        if hasattr(torch.ops.aten, "_grouped_mm"):
            try:
                library.impl("_grouped_mm", _grouped_mm, "Meta", allow_override=True)
            except (TypeError, RuntimeError):  # a torch that cannot override a kernel: its own stays
                pass
        yield
    finally:
        library._destroy()
