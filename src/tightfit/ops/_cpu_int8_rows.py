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

import numpy as np
import torch

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


def vectorwise_quant_cpu(rows: torch.Tensor, threshold: float, reference):
    """``reference()``'s (q, row_stats, outlier_cols) for non-empty (rows, K) ``rows``; with
    NaN or inf in it, or without numba, ``reference()`` itself."""
    numba = usable_numba("int8_vectorwise_quant", "running the reference kernel")
    if numba is None:
        return reference()
    rows = rows.contiguous()
    # torch compares with the threshold in A's dtype; past its range there are no outliers
    limit = float(torch.tensor(threshold, dtype=rows.dtype).float()) if threshold > 0.0 else float("inf")
    q = torch.empty(rows.shape, dtype=torch.int8)
    row_stats = torch.empty(rows.shape[0], dtype=torch.float32)
    outlier = torch.zeros(rows.shape[1], dtype=torch.uint8)
    bad = torch.zeros(rows.shape[0], dtype=torch.uint8)
    kernel, pieces = _kernel("quant", *rows.shape, numba)
    with kernel_lock:
        kernel(_as_bits(rows), np.float32(limit), q.numpy(), row_stats.numpy(), outlier.numpy(), bad.numpy(), pieces)
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
