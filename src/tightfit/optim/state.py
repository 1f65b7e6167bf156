"""An optimizer's per-parameter state, in bitsandbytes' layout, so that state dicts pass
between tightfit's optimizers and bitsandbytes' both ways.

Keys: ``step`` (steps taken), ``state1`` and, for two-state rules, ``state2`` (float32
shaped like the parameter, or uint8 codes when 8-bit), and when 8-bit ``qmap1`` /
``qmap2`` (the signed and unsigned dynamic maps) and ``absmax1`` / ``absmax2`` (float32,
one per block of 256). AdEMAMix's ``state1`` stacks its two EMAs: ``(2, *p.shape)``,
``absmax1`` ``(2, blocks)``. A parameter of fewer than ``min_8bit_size`` values keeps
32-bit state.

State read from outside (``load_state_dict``) is checked whole before any of it is used
(D9): every key, shape, dtype, a map of 256 sorted values, finite and non-negative scales.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tightfit.ops.blockwise import _code_on
from tightfit.ops.optimizer import OPTIMIZER_BLOCKSIZE, TWO_STATE_OPTIMIZERS

__all__ = ["MAP_BYTES", "check_state", "new_state", "planned_state_bytes", "shared_maps", "state_bytes"]

_MAPS = {"qmap1": "dynamic", "qmap2": "udynamic"}  # key -> the map bitsandbytes gives it
#: Bytes of one dynamic map (256 float32 values); a device holds one copy of each map.
MAP_BYTES = 256 * 4


def _blocks(p: torch.Tensor) -> int:
    return -(-p.numel() // OPTIMIZER_BLOCKSIZE)


def _first_shape(rule: str, p: torch.Tensor) -> tuple[int, ...]:
    return (2, *p.shape) if rule == "ademamix" else tuple(p.shape)


def _layout(rule: str, p: torch.Tensor, eight_bit: bool) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each state tensor's dtype and shape."""
    dtype = torch.uint8 if eight_bit else torch.float32
    layout = {"state1": (dtype, _first_shape(rule, p))}
    two = rule in TWO_STATE_OPTIMIZERS
    if two:
        layout["state2"] = (dtype, tuple(p.shape))
    if eight_bit:
        layout["qmap1"] = (torch.float32, (256,))
        layout["absmax1"] = (torch.float32, (2, _blocks(p)) if rule == "ademamix" else (_blocks(p),))
        if two:
            layout["qmap2"] = (torch.float32, (256,))
            layout["absmax2"] = (torch.float32, (_blocks(p),))
    return layout


def is_8bit(bits: int, min_8bit_size: int, p: torch.Tensor) -> bool:
    """Whether ``p``'s state is 8-bit: asked for, and ``p`` large enough."""
    return bits == 8 and p.numel() >= min_8bit_size


def new_state(rule: str, p: torch.Tensor, eight_bit: bool, device: torch.device, pin: bool) -> dict[str, Any]:
    """Zeroed state for ``p`` on ``device`` (``pin``: in page-locked host memory, for paged
    state an accelerator copies in asynchronously). The maps are the parameter's device's
    one copy of each dynamic map, which every parameter shares and the kernels know by
    identity (paged state too: they are 1 KiB each)."""
    state: dict[str, Any] = {"step": 0}
    for key, (dtype, shape) in _layout(rule, p, eight_bit).items():
        if key in _MAPS:
            state[key] = _code_on(_MAPS[key], p.device)
        else:
            state[key] = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    return state


def planned_state_bytes(rule: str, p: torch.Tensor, eight_bit: bool) -> int:
    """Bytes of the state ``p`` will have (``p`` may be on meta), the dynamic maps not
    counted: every parameter on a device shares that device's one copy of each."""
    return sum(
        dtype.itemsize * math.prod(shape)
        for key, (dtype, shape) in _layout(rule, p, eight_bit).items()
        if key not in _MAPS
    )


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of a parameter's state tensors."""
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def check_state(where: str, rule: str, p: torch.Tensor, state: Any) -> bool:
    """Whether loaded ``state`` for ``p`` is 8-bit; a clear error naming ``where`` and the
    key when it is not a state this rule can step from."""
    if not isinstance(state, dict):
        raise TypeError(f"{where} must be a dict of state tensors, got {type(state).__name__}")
    step = state.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}['step'] must be an int >= 0 (steps taken), got {step!r}")
    first = state.get("state1")
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{where} has no tensor 'state1'; keys: {sorted(state)}")
    eight_bit = first.dtype == torch.uint8
    for key, (dtype, shape) in _layout(rule, p, eight_bit).items():
        value = state.get(key)
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{where} has no tensor {key!r} ({'8-bit' if eight_bit else '32-bit'} {rule} state needs it)"
            )
        if value.dtype != dtype or tuple(value.shape) != shape:
            raise ValueError(
                f"{where}[{key!r}] must be {dtype} of shape {shape} for a parameter of shape {tuple(p.shape)}, got "
                f"{value.dtype} {tuple(value.shape)}"
            )
        if key in _MAPS and not bool((value[1:] >= value[:-1]).all()):
            raise ValueError(f"{where}[{key!r}] must be sorted ascending (the nearest-code search assumes it)")
        if dtype == torch.float32 and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where}[{key!r}] has NaN or inf values; an optimizer cannot step from them")
        if key.startswith("absmax") and bool((value < 0).any()):
            raise ValueError(f"{where}[{key!r}] has negative scales; absmax is a block's largest |value|")
    return eight_bit


def shared_maps(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` with its maps on ``device`` (the parameter's), each that equals its dynamic
    map replaced by the device's shared copy (a loaded state holds copies of its own)."""
    for key, name in _MAPS.items():
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            shared = _code_on(name, device)
            state[key] = shared if torch.equal(value.to(device), shared) else value.to(device)
    return state
