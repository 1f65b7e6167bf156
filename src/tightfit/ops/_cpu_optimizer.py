"""Fast CPU kernels for the optimizer updates of ``ops/optimizer``: native C where it builds
(``native/optimizer.c``, every path of ``_native``), else numba (in ``_kernels_blockwise``):
one fused pass per parameter, reading the gradient, the parameter
and the states once and writing each once, where the reference makes a float32 copy of
every state and of the parameter, and bitsandbytes' CPU step runs a dozen torch ops. They
follow the reference op for op in float32, so results are bit-identical.

Parameters in float32 or bfloat16 are read and written in place as their bits; float16
ones go through a float32 copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tightfit._strict import report_fallback
from tightfit.ops import _cpu_blockwise as cpu
from tightfit.ops._cpu_gemv import native_library
from tightfit.ops._native import DTYPE_CODES
from tightfit.ops._numba import kernel_lock, usable_numba

__all__: list[str] = []

#: The order of the float32 constants the kernels read (``optimizer_step``'s ``h``).
CONSTANTS = (
    "beta1",
    "beta2",
    "beta3",
    "rest1",
    "rest2",
    "rest3",
    "alpha",
    "eps",
    "decay",
    "keep",
    "lr",
    "inv_correction1",
    "inv_correction2",
    "step_size",
    "first",
)
_NO_FLOATS = np.empty(0, np.float32)
_NO_CODES = np.empty(0, np.uint8)
_NO_TABLE = np.empty(0, np.uint32)


def _bits(A: torch.Tensor) -> tuple[np.ndarray, int]:
    """A contiguous float32 or bf16 tensor's memory as its raw bits (written through), and
    the factor that widens them to float32 bits."""
    flat = A.view(-1)
    if A.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy().view(np.uint16), 1 << 16
    return flat.view(torch.int32).numpy().view(np.uint32), 1


def _constants(h: dict[str, float]) -> tuple[np.float32, ...]:
    """A tuple, not an array: the kernels' stores cannot alias it, so reads stay out of the loops."""
    return tuple(np.float32(h[name]) for name in CONSTANTS)


def _run(op: str, g: torch.Tensor, p: torch.Tensor, launch: Callable, reference: Callable[[], None]) -> None:
    """``launch(g bits, g widen, p bits, p widen)`` on p's memory (through a float32 copy for
    float16); the reference where numba is unusable (warned once, D1)."""
    if usable_numba(op, "running the reference kernel") is None:
        reference()
        return
    target = p if p.dtype != torch.float16 else p.float()
    grad = g.contiguous() if g.dtype == target.dtype else g.float().contiguous()
    g_bits, g_widen = _bits(grad)
    p_bits, p_widen = _bits(target)
    with kernel_lock:
        launch(g_bits, g_widen, p_bits, p_widen)
    if target is not p:
        p.copy_(target)


def update_32bit_cpu(rule: str, g, p, states: list[torch.Tensor], h: dict[str, float], reference) -> None:
    """The native kernel where it builds, else numba's, else the reference."""
    library = native_library("optimizer_update_32bit")
    if library is not None and p.dtype in DTYPE_CODES and g.dtype in DTYPE_CODES:
        _native_call(library.tf_optimizer_32bit, rule, g, p, [_pointers(states)], h)
        return
    arrays = [s.view(-1).numpy() for s in states] + [_NO_FLOATS] * (3 - len(states))

    def launch(g_bits, g_widen, p_bits, p_widen):
        cpu._kernels().any_32bit(
            _rule_index(rule), len(states), g_bits, g_widen, p_bits, p_widen, *arrays, p.numel(), _constants(h)
        )

    _run("optimizer_update_32bit", g, p, launch, reference)


def _rule_index(rule: str) -> int:
    from tightfit.ops.optimizer import OPTIMIZERS  # which imports this module

    return OPTIMIZERS.index(rule)


def update_8bit_cpu(
    rule: str,
    g,
    p,
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    maps: list[torch.Tensor],
    blocksize: int,
    h: dict[str, float],
    reference,
) -> None:
    """The native kernel where it builds (one pass, vectorized), else numba's, else the reference."""
    searches = [cpu.search_table(m.contiguous()) for m in maps]
    if not all(single for _, _, single in searches):  # a map with several bounds in a search bucket
        report_fallback(
            "optimizer_update_8bit_blockwise",
            "cpu",
            "reference",
            "a state map with several code boundaries in one search bucket runs the reference kernel",
        )
        reference()
        return
    tables = [table for _, table, _ in searches]
    library = native_library("optimizer_update_8bit_blockwise")
    if library is not None and p.dtype in DTYPE_CODES and g.dtype in DTYPE_CODES:
        _native_8bit(library, rule, g, p, codes, scales, maps, tables, h)
        return
    padding = 3 - len(codes)
    code_arrays = [c.view(-1).numpy() for c in codes] + [_NO_CODES] * padding
    scale_arrays = [a.view(-1).numpy() for a in scales] + [_NO_FLOATS] * padding
    map_arrays = [m.contiguous().numpy() for m in maps] + [_NO_FLOATS] * padding
    table_arrays = tables + [_NO_TABLE] * padding

    def launch(g_bits, g_widen, p_bits, p_widen):
        cpu._kernels().any_8bit(
            _rule_index(rule),
            len(codes),
            g_bits,
            g_widen,
            p_bits,
            p_widen,
            *code_arrays,
            *scale_arrays,
            *map_arrays,
            *table_arrays,
            p.numel(),
            blocksize,
            _constants(h),
        )

    _run("optimizer_update_8bit_blockwise", g, p, launch, reference)


def _native_8bit(library, rule: str, g, p, codes, scales, maps, tables, h) -> None:
    held = [m.float().contiguous() for m in maps], [torch.from_numpy(t) for t in tables]
    _native_call(library.tf_optimizer_8bit, rule, g, p, [_pointers(t) for t in (codes, scales, *held)], h)


def _pointers(tensors: list[torch.Tensor]) -> list[int | None]:
    """Up to three states' pointers, None for the states a rule has not."""
    return [t.data_ptr() for t in tensors] + [None] * (3 - len(tensors))


def _native_call(function, rule: str, g, p, pointers: list[list[int | None]], h: dict[str, float]) -> None:
    """A ``native/optimizer.c`` step: (rule, g, its dtype, p, its dtype, the states' pointers,
    n, constants, threads). The caller holds every tensor behind ``pointers`` during the call."""
    grad = g.contiguous()
    constants = torch.tensor([h[name] for name in CONSTANTS], dtype=torch.float32)
    function(
        _rule_index(rule),
        grad.data_ptr(),
        DTYPE_CODES[grad.dtype],
        p.data_ptr(),
        DTYPE_CODES[p.dtype],
        *[pointer for group in pointers for pointer in group],
        p.numel(),
        constants.data_ptr(),
        torch.get_num_threads(),
    )
