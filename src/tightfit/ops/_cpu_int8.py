"""Fast exact int8 matmul on the CPU (``A @ B.T`` into int32), in bounded scratch memory.

Without AVX-512, torch's ``_int_mm`` runs scalar code, 20-40x slower than a float32 GEMM.
Exact ways around it:

- few rows (decoding, up to ``NATIVE_ROWS``): the native kernel (``native/int8_rows.c``,
  built at first use, see ``_native``) reads each byte of B once, in registers, for all
  rows of A: with AVX-512 VNNI, unsigned-by-signed byte dot products (A shifted by 128,
  the shift taken off once per row of B); else bytes sign-extended to int16 and multiplied
  in pairs into int32 (AVX-512 or AVX2), or plain C with wrapping int32 sums elsewhere.
  Its only scratch is A shifted or widened (1 or 2 bytes a value, outside torch's
  allocator).
- many rows: float32 GEMMs of the int8 values, as bitsandbytes does, but exact: the K
  axis is cut into runs of 1024, where no partial sum, in whatever order a GEMM adds, can
  pass 2**24 (1024 * 128 * 128), so every one is an integer float32 holds; the runs are
  added in int32 (wrapping as int32 accumulation wraps). A and B are converted a run (and
  for B a block of rows, ``BLOCK_BYTES``) at a time into reused buffers, never whole (B
  whole would be 4x the weight); the first run's GEMMs write into the int32 output's own
  bytes seen as float32, converted in place.
- few rows without a native build: a numba kernel reads B's int8 bytes once, all rows of
  A at a time, with int32 accumulation (the D1 warning says the native one is missing).

With AVX-512 (bitsandbytes' rule), where float32 GEMMs may round their inputs (TF32/bf16
modes), or without numba for few rows, ``torch._int_mm`` (oneDNN). It is not exact
everywhere: with K = 1 it reads B's transpose with the wrong strides (garbage on AVX-512
CPUs), so K = 1 is an int32 outer product; and oneDNN's int8 GEMM without VNNI saturates
16-bit pair sums, so the path is taken only after a probe of such sums came back exact.

``TIGHTFIT_CPU_INT8_PATH`` (``int_mm``, ``float``, ``few_rows``, ``native``) pins the path
whatever the CPU has and whatever the row count, so every path is tested on any machine;
exactness still wins (rounding float32 GEMMs or a failed probe take the exact
alternative), and a pinned ``native`` without a native build takes the next one (after
the D1 warning). ``TIGHTFIT_CPU_KERNEL_PATH`` picks the native kernel's instruction set.
:func:`scratch_bytes` says what each path allocates besides the output, for the planner.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tightfit._strict import report_fallback
from tightfit.ops import _native
from tightfit.ops._numba import kernel_lock, usable_numba

__all__: list[str] = []

#: K run whose float32 sums are always exact: 1024 * 128 * 128 = 2**24.
EXACT_RUN = 1024
#: Bytes of B converted to float32 at a time (one K run of a block of rows).
BLOCK_BYTES = 1024 * 1024
#: At most this many rows of A go through the byte-reading kernel; above, the float GEMMs win.
FEW_ROWS = 32
#: At most this many rows of A go through the native kernel unpinned (the decoding case).
NATIVE_ROWS = 8


def _float32_is_ieee() -> bool:
    """False where the user let float32 GEMMs round their inputs (TF32/bf16 modes)."""
    for setting in (torch.backends.mkldnn.matmul, torch.backends.mkldnn, torch.backends):  # "none": inherited
        if setting.fp32_precision != "none":
            return setting.fp32_precision == "ieee"
    return True


#: The environment variable that pins a path, and the paths it accepts ("auto": by the CPU).
PATH_VARIABLE = "TIGHTFIT_CPU_INT8_PATH"
PATHS = ("int_mm", "float", "few_rows", "native")


def pinned_path() -> str | None:
    """The path ``TIGHTFIT_CPU_INT8_PATH`` pins, or None to choose by the CPU's features."""
    value = os.environ.get(PATH_VARIABLE, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in PATHS:
        raise ValueError(f"{PATH_VARIABLE}={value!r} is not a path; expected auto, {', '.join(PATHS)}")
    return value


@functools.lru_cache(maxsize=1)
def int_mm_is_exact() -> bool:
    """Whether ``torch._int_mm`` is exact on this CPU, checked once against the int32 product
    on random and extreme values (oneDNN's int8 GEMM without VNNI, for one, is not). Real
    tensors whatever modes are active: the first ask may come from a plan traced on fake
    tensors, or from inside a measured run (whose trackers must not see the probe)."""
    with _disable_current_modes(), torch.inference_mode():
        generator = torch.Generator().manual_seed(0)
        A = torch.randint(-128, 128, (8, 64), generator=generator, dtype=torch.int8)
        B = torch.randint(-128, 128, (16, 64), generator=generator, dtype=torch.int8)
        A[0], B[0], B[1] = 127, 127, -128  # 16-bit pair sums past 2**15 where A is shifted to unsigned
        return torch.equal(torch._int_mm(A, B.t()), A.to(torch.int32) @ B.to(torch.int32).t())


def _path(rows: int) -> str:
    """The path ``rows`` rows of A take (see :func:`_choose`)."""
    return _choose(rows)[0]


def _choose(rows: int) -> tuple[str, ctypes.CDLL | None]:
    """(path, the native library where the path is ``native``): the pinned path, else the one
    the CPU's features favour; then the first exact one (``native`` where it is built). The
    library is looked up at most once, and only where ``native`` is a candidate."""
    few, native = rows <= FEW_ROWS, ("native",) if rows <= NATIVE_ROWS else ()
    by_cpu = "int_mm" if torch.backends.cpu.get_cpu_capability() == "AVX512" else ("few_rows" if few else "float")
    pinned = pinned_path()
    first = (pinned,) if pinned is not None else (*native, by_cpu)  # oneDNN's int8 GEMM is fast with AVX-512
    library, looked_up = None, False
    for path in (*first, *native, "few_rows" if few else "float", "int_mm"):
        if path != "native":
            if _is_exact(path):
                return path, None
        else:
            if not looked_up:
                library, looked_up = _native_library(), True
            if library is not None:
                return path, library
    return "few_rows", None  # always exact


def _is_exact(path: str) -> bool:
    if path == "float":
        return _float32_is_ieee()
    if path == "int_mm":
        return int_mm_is_exact()
    return True  # few_rows: numba's int32 loop (or, without numba, the int32 reference)


def _native_library() -> ctypes.CDLL | None:
    """The native kernels' library, or None after reporting once why not (D1; not where
    ``TIGHTFIT_CPU_KERNEL_PATH=none`` asks for no native kernels)."""
    library, path_or_reason = _native.library()
    if library is None and _native.pinned_path() != "none":
        report_fallback(
            "int8_linear_matmul", "cpu", "native", f"{path_or_reason}; few-row products take numba or torch._int_mm"
        )
    return library


def _block_rows(out_features: int, in_features: int) -> int:
    return max(1, min(out_features, BLOCK_BYTES // (4 * min(in_features, EXACT_RUN))))


def scratch_bytes(rows: int, out_features: int, in_features: int) -> int:
    """Bytes :func:`linear_matmul_cpu` allocates besides its int32 output, all alive at
    its end: one K run of A and of a block of B as float32 and, past one run, the float32
    product of a run and a block."""
    if rows == 0 or out_features == 0 or in_features == 0 or _path(rows) != "float":
        return 0
    run = min(in_features, EXACT_RUN)
    block = _block_rows(out_features, in_features)
    product = 4 * rows * block if in_features > EXACT_RUN else 0
    return 4 * rows * run + 4 * block * run + product


def _float_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """K runs outside, blocks of B inside: A and B are each converted once, a piece at a time."""
    (rows, cols), out_features = A.shape, B.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.int32)
    run = min(cols, EXACT_RUN)
    block = _block_rows(out_features, cols)
    a_run = torch.empty(rows * run)
    b_run = torch.empty(block * run)
    product = torch.empty(rows * block) if cols > EXACT_RUN else None
    for k in range(0, cols, EXACT_RUN):
        width = min(cols - k, EXACT_RUN)
        a = a_run[: rows * width].view(rows, width)
        a.copy_(A[:, k : k + width])
        for start in range(0, out_features, block):
            stop = min(start + block, out_features)
            b = b_run[: (stop - start) * width].view(stop - start, width)
            b.copy_(B[start:stop, k : k + width])
            target = out[:, start:stop]
            if k == 0:  # the GEMM writes the output's own bytes, converted in place (read before written)
                as_float = target.view(torch.float32)
                torch.mm(a, b.t(), out=as_float)
                target.copy_(as_float)
            else:
                part = product[: rows * (stop - start)].view(rows, stop - start)
                torch.mm(a, b.t(), out=part)
                exact = part.view(torch.int32)
                exact.copy_(part)
                target.add_(exact)
    return out


def linear_matmul_cpu(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Exact ``A @ B.T`` for non-empty int8 ``A`` (M, K) and ``B`` (N, K), checked by the op."""
    path, library = _choose(A.shape[0])
    if path == "float":
        return _float_matmul(A, B)
    if path == "int_mm":
        return _int_mm(A, B)
    if path == "native":
        return _native_matmul(A, B, library)[0]
    if usable_numba("int8_linear_matmul", "few-row products use torch._int_mm where exact, else int32 torch.mm"):
        out = torch.empty(A.shape[0], B.shape[0], dtype=torch.int32)
        from tightfit.ops._kernels_int8 import few_rows

        with kernel_lock:
            few_rows(A.contiguous().numpy(), B.contiguous().numpy(), out.numpy())
        return out
    if int_mm_is_exact():
        return _int_mm(A, B)
    return A.to(torch.int32) @ B.to(torch.int32).t()


def linear_matmul_gathering(
    A: torch.Tensor, B: torch.Tensor, cols: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linear_matmul_cpu(A, B)``, and on the native path also ``B[:, cols]`` (int64
    ``cols``, each in range), copied in the same pass over B while each row is cached;
    elsewhere None (the caller gathers them later, as the reference does)."""
    path, library = _choose(A.shape[0])
    if path == "native":
        return _native_matmul(A, B, library, cols)
    return linear_matmul_cpu(A, B), None


def _native_matmul(
    A: torch.Tensor, B: torch.Tensor, library: ctypes.CDLL, cols: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The native kernel on contiguous copies, whose pointers are valid for the sizes it is
    given; and, for ``cols``, B's bytes there (N x len(cols))."""
    a, b = A.contiguous(), B.contiguous()
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.int32)
    index = None if cols is None else cols.to(torch.int64).contiguous()
    gathered = None if index is None else torch.empty(b.shape[0], index.numel(), dtype=torch.int8)
    library.tf_int8_matmul_rows(
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
        a.shape[0],
        b.shape[0],
        a.shape[1],
        torch.get_num_threads(),
        int(_native.VNNI),
        None if index is None else index.data_ptr(),
        0 if index is None else index.numel(),
        None if gathered is None else gathered.data_ptr(),
    )
    return out, gathered


def _int_mm(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    if A.shape[1] == 1:  # torch._int_mm misreads B.t() of shape (1, N): exact outer product instead
        return A.to(torch.int32) * B.to(torch.int32).t()
    return torch._int_mm(A.contiguous(), B.t())
