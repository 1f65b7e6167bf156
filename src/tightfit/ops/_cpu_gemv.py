"""Few-token matmuls against blockwise codes on the CPU through the native kernels
(``native/gemv_blockwise.c``): each stored byte read once, decoded in registers.

The caller has checked shapes, dtypes and lengths (the op's check, D9); here every tensor
is made contiguous in the dtype the C code reads, so the pointers it gets are valid for
the sizes it is given. Returns None where no native library could be built (the caller
falls back to its numba or reference kernel, which reports it).
"""

from __future__ import annotations

import torch

from tightfit._strict import report_fallback
from tightfit.ops import _native

__all__: list[str] = []


def native_library(op: str):
    """The native library, or None after reporting once why ``op`` takes its numba or
    reference kernel instead (D1; not where ``TIGHTFIT_CPU_KERNEL_PATH=none`` asks for that)."""
    library, path_or_reason = _native.library()
    if library is None and _native.pinned_path() != "none":
        report_fallback(op, "cpu", "native", f"{path_or_reason}; running the numba or reference kernel")
    return library


def gemv_blockwise(
    A: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    shape: list[int] | tuple[int, int],
    absmax: torch.Tensor,
    table: torch.Tensor,
    blocksize: int,
    op: str,
    nested: tuple[torch.Tensor | None, torch.Tensor | None, int, torch.Tensor | None],
) -> torch.Tensor | None:
    """``A @ decode(codes).T`` in float32 (``A``'s rows flattened), or None where no native
    library could be built. ``absmax`` holds one scale per block of the flattened weight,
    or, with ``nested`` = (absmax2, code2, nested_blocksize, offset), their uint8 codes."""
    library = native_library(op)
    if library is None:
        return None
    rows, cols = shape
    x, w, out, scale_args, _keep = _operands(A, codes, rows, cols, absmax, nested)
    table32 = table.float().contiguous()
    library.tf_gemv_blockwise(
        x.data_ptr(),
        w.data_ptr(),
        bits,
        *scale_args,
        table32.data_ptr(),
        x.shape[0],
        rows,
        cols,
        blocksize,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def gemv_4bit_int8(
    A: torch.Tensor,
    codes: torch.Tensor,
    shape: list[int] | tuple[int, int],
    absmax: torch.Tensor,
    table8: torch.Tensor,
    blocksize: int,
    nested: tuple[torch.Tensor | None, torch.Tensor | None, int, torch.Tensor | None],
) -> torch.Tensor | None:
    """``A`` quantized to int8 per 32, times 4-bit ``codes`` decoded through the int8 table
    ``table8`` (``native/gemv_4bit_int8.c``), in float32; or None where no native library
    could be built. Scales as for :func:`gemv_blockwise`."""
    library = native_library("gemv_4bit_int8")
    if library is None:
        return None
    rows, cols = shape
    x, w, out, scale_args, _keep = _operands(A, codes, rows, cols, absmax, nested)
    table = table8.to(torch.int8).contiguous()
    library.tf_gemv_4bit_int8(
        x.data_ptr(),
        w.data_ptr(),
        *scale_args,
        table.data_ptr(),
        x.shape[0],
        rows,
        cols,
        blocksize,
        out.data_ptr(),
        torch.get_num_threads(),
        int(_native.VNNI),
    )
    return out


def _operands(A, codes, rows: int, cols: int, absmax: torch.Tensor, nested: tuple) -> tuple:
    """What both kernels read and write: x (A's rows in float32), the code bytes, the float32
    output, the scale arguments and the tensors behind them (held until the call returns)."""
    x = A.reshape(-1, cols).float().contiguous()
    w = codes.reshape(-1).view(torch.uint8).contiguous()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    scale_args, keep = _scale_arguments(absmax, nested)
    return x, w, out, scale_args, keep


def _scale_arguments(absmax: torch.Tensor, nested: tuple) -> tuple[tuple, list[torch.Tensor]]:
    """The C functions' six scale arguments (absmax, qabsmax, code2, absmax2, nested_blocksize,
    offset), and the tensors behind their pointers (held by the caller until the call returns)."""
    absmax2, code2, nested_blocksize, offset = nested
    if absmax2 is None:
        scales = absmax.float().contiguous()
        return (scales.data_ptr(), None, None, None, nested_blocksize, 0.0), [scales]
    qscales, code2, absmax2 = absmax.contiguous(), code2.contiguous(), absmax2.contiguous()
    args = (None, qscales.data_ptr(), code2.data_ptr(), absmax2.data_ptr(), nested_blocksize, float(offset))
    return args, [qscales, code2, absmax2]
