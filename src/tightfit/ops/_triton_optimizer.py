"""Triton kernels for the optimizer updates of ``ops/optimizer`` on GPUs (imported at first use).

They follow the reference operation for operation in float32: launched without
floating-point fusion (no product and sum contracted into one rounding), with
IEEE-rounded division and square root (Triton's plain ``/`` and ``sqrt`` are approximate
on NVIDIA GPUs). The 8-bit kernel holds ``GROUP`` whole blocks of 256 in registers: it
decodes the states, steps, takes each block's new absmax and codes the new states
with the blockwise quantizer's table search, so every byte is read and written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tightfit.ops._triton_blockwise import _block_absmax, _nearest, _scaled

__all__: list[str] = []

_GROUP = 4  # blocks of 256 per 8-bit program
_TILE = 1024  # values per 32-bit program
_WARPS = 4
_MINIMUM_ABSMAX = 1e-38


@triton.jit
def _step(
    RULE: tl.constexpr,
    g,
    p,
    s0,
    s1,
    s2,
    beta1,
    beta2,
    beta3,
    rest1,
    rest2,
    rest3,
    alpha,
    eps,
    decay,
    keep,
    lr,
    inv_correction1,
    inv_correction2,
    step_size,
    first,
):
    """One update (the reference's ``_step``): RULE indexes OPTIMIZERS."""
    if RULE >= 2 and RULE <= 4:
        g = tl.where(decay > 0, g + p * decay, g)
    if RULE <= 1 or RULE == 5:
        p = tl.where(decay > 0, p * keep, p)
    if RULE == 0:  # adam
        s0 = s0 * beta1 + g * rest1
        s1 = s1 * beta2 + (g * g) * rest2
        p = p + tl.math.div_rn(s0, tl.math.sqrt_rn(s1) * inv_correction2 + eps) * step_size
    elif RULE == 1:  # ademamix
        s0 = s0 * beta1 + g * rest1
        s1 = s1 * beta3 + g * rest3
        s2 = s2 * beta2 + (g * g) * rest2
        mixed = s0 * inv_correction1 + s1 * alpha
        p = p - tl.math.div_rn(mixed, tl.math.sqrt_rn(s2) * inv_correction2 + eps) * lr
    elif RULE == 2:  # momentum
        s0 = tl.where(first != 0, g, s0 * beta1 + g)
        p = p - s0 * lr
    elif RULE == 3:  # rmsprop
        s0 = s0 * beta1 + (g * g) * rest1
        p = p - tl.math.div_rn(g, tl.math.sqrt_rn(s0) + eps) * lr
    elif RULE == 4:  # adagrad
        s0 = s0 + g * g
        p = p - tl.math.div_rn(g, tl.math.sqrt_rn(s0) + eps) * lr
    else:  # lion
        mixed = s0 * beta1 + g * rest1
        direction = (mixed > 0).to(tl.float32) - (mixed < 0).to(tl.float32)
        s0 = s0 * beta2 + g * rest2
        p = p - direction * lr
    return p, s0, s1, s2


@triton.jit
def _update_32bit_kernel(
    g_ptr, p_ptr, s0_ptr, s1_ptr, s2_ptr, numel,
    beta1, beta2, beta3, rest1, rest2, rest3, alpha, eps, decay, keep, lr, inv_correction1, inv_correction2,
    step_size, first,
    RULE: tl.constexpr, COUNT: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = offsets < numel
    g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offsets, mask=inside, other=0.0)
    s0 = tl.load(s0_ptr + offsets, mask=inside, other=0.0)
    s1 = tl.load(s1_ptr + offsets, mask=inside, other=0.0) if COUNT > 1 else s0
    s2 = tl.load(s2_ptr + offsets, mask=inside, other=0.0) if COUNT > 2 else s0
    new_p, s0, s1, s2 = _step(
        RULE, g, p.to(tl.float32), s0, s1, s2, beta1, beta2, beta3, rest1, rest2, rest3, alpha, eps, decay, keep, lr,
        inv_correction1, inv_correction2, step_size, first,
    )  # fmt: skip
    tl.store(p_ptr + offsets, new_p.to(p.dtype), mask=inside)
    tl.store(s0_ptr + offsets, s0, mask=inside)
    if COUNT > 1:
        tl.store(s1_ptr + offsets, s1, mask=inside)
    if COUNT > 2:
        tl.store(s2_ptr + offsets, s2, mask=inside)


@triton.jit
def _decoded(codes_ptr, absmax_ptr, map_ptr, offsets, inside, blocks, n_blocks):
    codes = tl.load(codes_ptr + offsets, mask=inside, other=0).to(tl.int32)
    scales = tl.load(absmax_ptr + blocks, mask=blocks < n_blocks, other=0.0)
    return tl.where(inside, tl.load(map_ptr + codes) * scales[:, None], 0.0)  # lanes past the end: 0


@triton.jit
def _coded(
    value, inside, tail, codes_ptr, absmax_ptr, bounds_ptr, table_ptr, offsets, blocks, n_blocks, MINIMUM: tl.constexpr
):
    """Store ``value``'s blocks as codes and absmax, as ``quantize_blockwise`` would."""
    value = tl.where(inside, value, 0.0)
    absmax = _block_absmax(value)
    tl.store(absmax_ptr + blocks, tl.where(tail, tl.maximum(absmax, MINIMUM), absmax), mask=blocks < n_blocks)
    codes = _nearest(_scaled(value, absmax, tail, MINIMUM), bounds_ptr, table_ptr, 8, True)
    tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=inside)


@triton.jit
def _update_8bit_kernel(
    g_ptr, p_ptr, c0_ptr, c1_ptr, c2_ptr, a0_ptr, a1_ptr, a2_ptr, m0_ptr, m1_ptr, m2_ptr,
    b0_ptr, b1_ptr, b2_ptr, t0_ptr, t1_ptr, t2_ptr, numel, n_blocks,
    beta1, beta2, beta3, rest1, rest2, rest3, alpha, eps, decay, keep, lr, inv_correction1, inv_correction2,
    step_size, first,
    RULE: tl.constexpr, COUNT: tl.constexpr, GROUP: tl.constexpr, BLOCKSIZE: tl.constexpr, MINIMUM: tl.constexpr,
):  # fmt: skip
    blocks = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    offsets = blocks[:, None].to(tl.int64) * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    inside = offsets < numel
    tail = (blocks.to(tl.int64) + 1) * BLOCKSIZE > numel
    g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offsets, mask=inside, other=0.0)
    s0 = _decoded(c0_ptr, a0_ptr, m0_ptr, offsets, inside, blocks, n_blocks)
    s1 = _decoded(c1_ptr, a1_ptr, m1_ptr, offsets, inside, blocks, n_blocks) if COUNT > 1 else s0
    s2 = _decoded(c2_ptr, a2_ptr, m2_ptr, offsets, inside, blocks, n_blocks) if COUNT > 2 else s0
    new_p, s0, s1, s2 = _step(
        RULE, g, p.to(tl.float32), s0, s1, s2, beta1, beta2, beta3, rest1, rest2, rest3, alpha, eps, decay, keep, lr,
        inv_correction1, inv_correction2, step_size, first,
    )  # fmt: skip
    tl.store(p_ptr + offsets, new_p.to(p.dtype), mask=inside)
    _coded(s0, inside, tail, c0_ptr, a0_ptr, b0_ptr, t0_ptr, offsets, blocks, n_blocks, MINIMUM)
    if COUNT > 1:
        _coded(s1, inside, tail, c1_ptr, a1_ptr, b1_ptr, t1_ptr, offsets, blocks, n_blocks, MINIMUM)
    if COUNT > 2:
        _coded(s2, inside, tail, c2_ptr, a2_ptr, b2_ptr, t2_ptr, offsets, blocks, n_blocks, MINIMUM)


def _hyper_args(h: dict[str, float], constants: tuple[str, ...]) -> list[float]:
    return [float(h[name]) for name in constants]


def update_32bit(rule: int, g, p, states: list[torch.Tensor], h: dict[str, float], constants: tuple[str, ...]) -> None:
    """One step in place on a contiguous ``p`` and float32 ``states``."""
    numel = p.numel()
    if not numel:
        return
    flat = [s.view(-1) for s in states] + [states[0].view(-1)] * (3 - len(states))
    _update_32bit_kernel[(triton.cdiv(numel, _TILE),)](
        g.contiguous().view(-1), p.view(-1), *flat, numel, *_hyper_args(h, constants),
        RULE=rule, COUNT=len(states), TILE=_TILE, num_warps=_WARPS, enable_fp_fusion=False,
    )  # fmt: skip


def update_8bit(
    rule: int,
    g,
    p,
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    searches: list[tuple[torch.Tensor, torch.Tensor, bool]],
    maps: list[torch.Tensor],
    h: dict[str, float],
    constants: tuple[str, ...],
) -> None:
    """One step in place with 8-bit states; ``searches`` from ``search_tables`` (one step each)."""
    numel = p.numel()
    if not numel:
        return
    n_blocks = scales[0].numel()
    pad = 3 - len(codes)
    flat = [c.view(-1) for c in codes] + [codes[0].view(-1)] * pad
    absmax = [a.view(-1) for a in scales] + [scales[0].view(-1)] * pad
    tables = [m.float().contiguous() for m in maps] + [maps[0].float().contiguous()] * pad
    bounds = [b for b, _, _ in searches] + [searches[0][0]] * pad
    table = [t for _, t, _ in searches] + [searches[0][1]] * pad
    _update_8bit_kernel[(triton.cdiv(n_blocks, _GROUP),)](
        g.contiguous().view(-1), p.view(-1), *flat, *absmax, *tables, *bounds, *table, numel, n_blocks,
        *_hyper_args(h, constants),
        RULE=rule, COUNT=len(codes), GROUP=_GROUP, BLOCKSIZE=256, MINIMUM=_MINIMUM_ABSMAX, num_warps=_WARPS,
        enable_fp_fusion=False,
    )  # fmt: skip
