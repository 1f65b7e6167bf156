"""Few-token matmuls against blockwise codes on the CPU through the native kernels
(``native/gemv_blockwise.c``): each stored byte read once, decoded in registers.

The caller has checked shapes, dtypes and lengths (the op's check, D9); here every tensor
is made contiguous in the dtype the C code reads, so the pointers it gets are valid for
the sizes it is given. Returns None where no native library could be built (the caller
falls back to its numba or reference kernel, which reports it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tightfit._strict import report_fallback
from tightfit.ops import _native
from tightfit.ops._direct import not_held

__all__: list[str] = []


def native_library(op: str):
    """The native library, or None after reporting once why ``op`` takes its numba or
    reference kernel instead (D1; not where ``TIGHTFIT_CPU_KERNEL_PATH=none`` asks for that)."""
    library, path_or_reason = _native.library()
    if library is None and _native.pinned_path() != "none":
        report_fallback(op, "cpu", "native", f"{path_or_reason}; running the numba or reference kernel")
    return library


class BoundKernel:
    """A few-token kernel with one weight's arguments bound (its pointers, scales and shape),
    called with contiguous rows of activations in a float dtype the kernels read
    (``_native.DTYPE_CODES``); returns the product in that dtype. Holds the tensors behind
    its pointers except those the binder said it holds itself (``held``: a quantized layer's
    weight and scales, which it may drop, :mod:`tightfit.ops._direct`)."""

    __slots__ = ("_function", "_before", "_shape", "_vnni", "_keep")

    def __init__(self, function, before: tuple, shape: tuple, vnni: bool, keep: list[torch.Tensor]) -> None:
        self._function, self._before, self._shape, self._vnni, self._keep = function, before, shape, vnni, keep

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_features, in_features, blocksize = self._shape
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device="cpu")
        after = (int(_native.VNNI),) if self._vnni else ()  # read per call: tests switch it
        self._function(
            x.data_ptr(),
            *self._before,
            x.shape[0],
            out_features,
            in_features,
            blocksize,
            out.data_ptr(),
            torch.get_num_threads(),
            *after,
            _native.DTYPE_CODES[x.dtype],
        )
        return out

    def matmul(self, A: torch.Tensor) -> torch.Tensor:
        """``A @ W.T`` for ``A`` of any leading shape (the last its in_features), in ``A``'s dtype."""
        out_features, in_features, _ = self._shape
        return self(A.reshape(-1, in_features).contiguous()).reshape(*A.shape[:-1], out_features)


#: What the binders take for a weight's block scales: (absmax2, code2, nested_blocksize, offset).
Nested = tuple[torch.Tensor | None, torch.Tensor | None, int, torch.Tensor | None]


def _bind(
    op: str,
    function: str,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    nested: Nested,
    table: torch.Tensor,
    geometry: tuple[int, int, int],
    held: Sequence[torch.Tensor],
    lead: tuple = (),
    trail: tuple = (),
    vnni: bool = False,
) -> BoundKernel | None:
    """The library's ``function`` bound to a weight (its arguments: x, the code bytes,
    ``lead``, the six scale arguments, the table, ``trail``), or None without a native build."""
    library = native_library(op)
    if library is None:
        return None
    w = codes.reshape(-1).view(torch.uint8).contiguous()
    scale_args, keep = _scale_arguments(absmax, nested)
    before = (w.data_ptr(), *lead, *scale_args, table.data_ptr(), *trail)
    return BoundKernel(getattr(library, function), before, geometry, vnni, not_held([w, table, *keep], held))


def bind_gemv_blockwise(
    codes: torch.Tensor,
    bits: int,
    shape: list[int] | tuple[int, int],
    absmax: torch.Tensor,
    table: torch.Tensor,
    blocksize: int,
    op: str,
    nested: Nested,
    held: Sequence[torch.Tensor] = (),
) -> BoundKernel | None:
    """``x @ decode(codes).T`` for ``codes`` of ``shape`` (out x in) as a bound kernel
    (``native/gemv_blockwise.c``), or None where no native library could be built.
    ``absmax`` holds one scale per block of the flattened weight, or, with ``nested`` =
    (absmax2, code2, nested_blocksize, offset), their uint8 codes. ``held``: tensors among
    these that the caller keeps alive while it uses the kernel (:class:`BoundKernel`)."""
    table32 = table.float().contiguous()
    geometry = (*shape, blocksize)
    return _bind(op, "tf_gemv_blockwise", codes, absmax, nested, table32, geometry, held, lead=(bits,))


def bind_gemv_4bit_int8(
    codes: torch.Tensor,
    shape: list[int] | tuple[int, int],
    absmax: torch.Tensor,
    table8: torch.Tensor,
    blocksize: int,
    nested: Nested,
    held: Sequence[torch.Tensor] = (),
) -> BoundKernel | None:
    """``x`` quantized to int8 per 32, times 4-bit ``codes`` decoded through the int8 table
    ``table8`` (``native/gemv_4bit_int8.c``), as a bound kernel; or None where no native
    library could be built. Scales as for :func:`bind_gemv_blockwise`."""
    table = table8.to(torch.int8).contiguous()
    geometry = (*shape, blocksize)
    return _bind("gemv_4bit_int8", "tf_gemv_4bit_int8", codes, absmax, nested, table, geometry, held, vnni=True)


def bind_gemv_8bit_int8(
    codes: torch.Tensor,
    shape: list[int] | tuple[int, int],
    absmax: torch.Tensor,
    table16: torch.Tensor,
    unit: float,
    blocksize: int,
    nested: Nested,
    held: Sequence[torch.Tensor] = (),
) -> BoundKernel | None:
    """``x`` quantized to int8 per 32, times 8-bit ``codes`` decoded through the int16 table
    ``table16`` times ``unit`` (``native/gemv_8bit_int8.c``), as a bound kernel; or None
    where no native library could be built. Scales as for :func:`bind_gemv_blockwise`."""
    table = table16.to(torch.int16).contiguous()
    geometry = (*shape, blocksize)
    return _bind(
        "gemv_blockwise_int8",
        "tf_gemv_8bit_int8",
        codes,
        absmax,
        nested,
        table,
        geometry,
        held,
        trail=(unit,),
        vnni=True,
    )


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
