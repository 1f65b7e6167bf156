"""LLM.int8()'s row-wise steps on the CPU, one numba pass per row each, bit-identical to
the reference kernels in :mod:`tightfit.ops.int8`.

The reference builds several full-size temporaries per call (the masked input, its
absolute values, the scaled product, the outer product of the scales); these kernels
read their input once (a row stays in cache between the two sweeps of the quantizer)
and write only the result, allocating next to nothing besides their outputs (see
:func:`vectorwise_peak_bytes`, the planner's figure). 16-bit values are widened and
rounded bit by bit, as torch rounds: numba has no float16 type.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from tightfit.ops import _native
from tightfit.ops._numba import kernel_lock, load_numba, usable_numba

__all__: list[str] = []

#: Elements below which one thread runs an op (a pass over 2**18 float32 takes about 0.1 ms):
#: a parallel region waits for every thread, a scheduler slice (milliseconds) where another
#: process holds a core, which only a larger op repays.
PARALLEL_MIN = 1 << 18


def _kernels():
    """The op's drivers, by (parallel, op), from ``_kernels_int8_rows``: imported at first
    use, as it imports numba."""
    from tightfit.ops import _kernels_int8_rows as kernels

    return {
        (False, "quant"): kernels.vectorwise_quant,
        (True, "quant"): kernels.vectorwise_quant_parallel,
        (False, "dequant"): kernels.mm_dequant,
        (True, "dequant"): kernels.mm_dequant_parallel,
    }


def _kernel(op: str, rows: int, cols: int, numba):
    """The op's driver and its piece count: one thread below ``PARALLEL_MIN`` elements."""
    threads = numba.get_num_threads()
    parallel = threads > 1 and rows > 1 and rows * cols >= PARALLEL_MIN
    return _kernels()[parallel, op], min(threads, rows) if parallel else 1


def _as_bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous float tensor's bytes as the kernels read and write them: float32 as
    uint32 (or float32 for output), bfloat16 as uint16, float16 as int16."""
    array = tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int16).numpy()
    if tensor.dtype == torch.float16:
        return array
    return array.view(np.uint32 if tensor.dtype == torch.float32 else np.uint16)


def vectorwise_peak_bytes(rows: int, cols: int, outliers: int) -> int | None:
    """Bytes :func:`vectorwise_quant_cpu` holds at its peak for finite contiguous input,
    its outputs included: the codes, the row scales, the column and row flags, then the
    outlier indices (or, with none, the test of the row flags). None without numba, where
    the reference runs. :func:`mm_dequant_cpu` allocates nothing besides its output."""
    if load_numba()[0] is None:
        return None
    return rows * cols + 5 * rows + cols + max(1, 8 * outliers)


def _native_steps(rows: int, cols: int):
    """The native library for a call this small (one thread's work: numba's dispatch costs
    more than the call), or None: numba runs it."""
    if rows * cols >= PARALLEL_MIN:
        return None
    library, _ = _native.library()
    return library


@functools.lru_cache(maxsize=64)
def _limit(threshold: float, dtype: torch.dtype) -> float:
    """The magnitude an outlier reaches: torch compares with the threshold in the input's
    dtype; past its range (or at threshold 0) there are no outliers."""
    return float(torch.tensor(threshold, dtype=dtype).float()) if threshold > 0.0 else float("inf")


def _quant_outputs(rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """What the quantizer writes: the codes, the row scales, the column flags and the row
    flags (the flags zeroed)."""
    return (
        torch.empty(rows, cols, dtype=torch.int8),
        torch.empty(rows, dtype=torch.float32),
        torch.zeros(cols, dtype=torch.uint8),
        torch.zeros(rows, dtype=torch.uint8),
    )


def vectorwise_quant_cpu(rows: torch.Tensor, threshold: float, reference):
    """``reference()``'s (q, row_stats, outlier_cols) for non-empty (rows, K) ``rows``; with
    NaN or inf in it, or without numba, ``reference()`` itself. Small calls take the native
    port of the numba kernel (``native/int8_steps.c``): the same bits and allocations."""
    numba = usable_numba("int8_vectorwise_quant", "running the reference kernel")
    if numba is None:
        return reference()
    rows = rows.contiguous()
    limit = _limit(threshold, rows.dtype)
    q, row_stats, outlier, bad = _quant_outputs(*rows.shape)
    library = _native_steps(*rows.shape) if rows.dtype in _native.DTYPE_CODES else None
    if library is not None:
        library.tf_int8_quant_rows(
            rows.data_ptr(),
            _native.DTYPE_CODES[rows.dtype],
            rows.shape[0],
            rows.shape[1],
            limit,
            q.data_ptr(),
            row_stats.data_ptr(),
            outlier.data_ptr(),
            bad.data_ptr(),
        )
    else:
        kernel, pieces = _kernel("quant", *rows.shape, numba)
        with kernel_lock:
            kernel(
                _as_bits(rows), np.float32(limit), q.numpy(), row_stats.numpy(), outlier.numpy(), bad.numpy(), pieces
            )
    if bool(bad.any()):
        return reference()
    return q, row_stats, torch.argwhere(outlier).view(-1)


def mm_dequant_cpu(rows: torch.Tensor, row_stats, col_stats, scale: float, dtype, bias, reference):
    """``reference()``'s result for a non-empty int32 (rows, N) ``rows``, computed in float32
    as it does; a float64 bias (which promotes the sum to float64), or no numba: ``reference()``."""
    numba = usable_numba("int8_mm_dequant", "running the reference kernel")
    if numba is None or (bias is not None and bias.dtype == torch.float64):
        return reference()
    out = torch.empty(rows.shape, dtype=dtype)
    float32 = row_stats.dtype == col_stats.dtype == torch.float32 and rows.dtype == torch.int32
    native = float32 and dtype in _native.DTYPE_CODES and (bias is None or bias.dtype in _native.DTYPE_CODES)
    library = _native_steps(*rows.shape) if native else None
    if library is not None:
        rows, row_stats, col_stats = rows.contiguous(), row_stats.contiguous(), col_stats.contiguous()
        bias = None if bias is None else bias.contiguous()
        library.tf_int8_dequant_rows(
            rows.data_ptr(),
            rows.shape[0],
            rows.shape[1],
            row_stats.data_ptr(),
            col_stats.data_ptr(),
            scale,
            None if bias is None else bias.data_ptr(),
            -1 if bias is None else _native.DTYPE_CODES[bias.dtype],
            out.data_ptr(),
            _native.DTYPE_CODES[dtype],
        )
        return out
    bias_bits = np.empty(0, np.uint32) if bias is None else _as_bits(bias.contiguous())
    kernel, pieces = _kernel("dequant", *rows.shape, numba)
    with kernel_lock:
        kernel(
            rows.contiguous().numpy(),
            row_stats.contiguous().view(-1).numpy(),
            col_stats.contiguous().view(-1).numpy(),
            np.float32(scale),
            bias_bits,
            out.numpy() if dtype == torch.float32 else _as_bits(out),
            pieces,
        )
    return out


def linear_rows(rows: torch.Tensor, weight: torch.Tensor, SCB: torch.Tensor, bias, threshold: float, dtype):
    """LLM.int8()'s whole forward for a few rows in one native call (quantize, the exact
    product, dequantize: the steps' own kernels, so the reference's bits and the steps'
    allocations), where the int8 product takes its native path; None where it does not,
    or where a column holds an outlier (the steps then run one by one). NaN or inf raises."""
    from tightfit.ops import _cpu_int8  # these import this module
    from tightfit.ops.int8 import INV_127_SQUARED, NON_FINITE

    M, K = rows.shape
    if M == 0 or K == 0 or weight.shape[0] == 0 or M > _cpu_int8.NATIVE_ROWS:
        return None
    if rows.dtype not in _native.DTYPE_CODES or SCB.dtype != torch.float32:
        return None
    if usable_numba("int8_vectorwise_quant", "running the reference kernel") is None:
        return None  # the steps' reference kernels run, and the planner counts theirs
    path, library = _cpu_int8._choose(M)
    if path != "native":
        return None
    rows = rows.contiguous()
    weight, SCB = weight.contiguous(), SCB.contiguous()  # held here: a temporary's pointer dies with it
    limit = _limit(threshold, rows.dtype)
    q, row_stats, outlier, bad = _quant_outputs(M, K)
    product = torch.empty(M, weight.shape[0], dtype=torch.int32)
    out = torch.empty(M, weight.shape[0], dtype=dtype)
    bias = None if bias is None else bias.to(dtype).contiguous()  # as the steps take it
    status = library.tf_int8_linear_rows(
        rows.data_ptr(),
        _native.DTYPE_CODES[rows.dtype],
        M,
        K,
        limit,
        weight.data_ptr(),
        weight.shape[0],
        SCB.data_ptr(),
        INV_127_SQUARED,
        None if bias is None else bias.data_ptr(),
        -1 if bias is None else _native.DTYPE_CODES[bias.dtype],
        out.data_ptr(),
        _native.DTYPE_CODES[dtype],
        torch.get_num_threads(),
        int(_native.VNNI),
        q.data_ptr(),
        row_stats.data_ptr(),
        outlier.data_ptr(),
        bad.data_ptr(),
        product.data_ptr(),
    )
    if status == 1:
        raise ValueError(NON_FINITE)
    return out if status == 0 else None
