"""Optimizer updates as ops: one step of Adam (AdamW), AdEMAMix, SGD with momentum, RMSprop,
Adagrad or Lion on one parameter, with 32-bit states or bitsandbytes' 8-bit blockwise states.

The 8-bit state is bitsandbytes' format: each state a uint8 code per value into its
dynamic map (signed for first moments, unsigned for second), with one float32 absmax per
block of :data:`OPTIMIZER_BLOCKSIZE` values. A step decodes the states, updates them and
the parameter in float32, and codes the new states again, each block scaled by its new
absmax (nearest entry, as :func:`tightfit.ops.quantize_blockwise`). AdEMAMix's first state
holds its two EMAs stacked, ``(2, *p.shape)``, with absmax ``(2, blocks)``. The reference
kernels below are the specification; bitsandbytes' CPU kernels compute the same formulas.

Hyperparameters, as bitsandbytes passes them: ``beta1`` / ``beta2`` the moments' decays
(SGD: ``beta1`` is the momentum; RMSprop: ``beta1`` is its alpha; Lion: ``beta1`` mixes
the update's direction, ``beta2`` decays the momentum), ``beta3`` and ``alpha`` AdEMAMix's
slow EMA and its weight. Weight decay is decoupled (``p *= 1 - lr * weight_decay``) for
Adam, AdEMAMix and Lion, added to the gradient for the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

import torch

from tightfit._strict import report_fallback
from tightfit._validate import check_choice, check_same_device, check_type
from tightfit.ops import _cpu_optimizer as _cpu
from tightfit.ops import blockwise
from tightfit.ops._arg_checks import FLOAT_DTYPES, block_count
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.blockwise import _dequantize_blockwise_reference, _quantize_blockwise_reference
from tightfit.ops.codes import dynamic_map

__all__ = [
    "OPTIMIZER_BLOCKSIZE",
    "OPTIMIZERS",
    "TWO_STATE_OPTIMIZERS",
    "optimizer_update_32bit",
    "optimizer_update_8bit_blockwise",
]

#: Values per absmax in an 8-bit optimizer state (bitsandbytes' fixed choice).
OPTIMIZER_BLOCKSIZE = 256
#: The update rules, by bitsandbytes' names; the kernels take the index.
OPTIMIZERS = ("adam", "ademamix", "momentum", "rmsprop", "adagrad", "lion")
#: Those with a second state (``state2``); the rest take None.
TWO_STATE_OPTIMIZERS = ("adam", "ademamix")


# -- reference kernels (the specification) ----------------------------------------------


def _hyper(
    beta1: float, beta2: float, beta3: float, alpha: float, eps: float, weight_decay: float, step: int, lr: float
) -> dict[str, float]:
    """The float32 constants a step multiplies by, computed in double (torch rounds a Python
    float to the tensor's float32 at each op); bias corrections as reciprocals, so that
    every kernel multiplies (torch's division by a scalar is not the float32 division)."""
    return {
        "beta1": beta1,
        "beta2": beta2,
        "beta3": beta3,
        "rest1": 1.0 - beta1,
        "rest2": 1.0 - beta2,
        "rest3": 1.0 - beta3,
        "alpha": alpha,
        "eps": eps,
        "decay": weight_decay,
        "keep": 1.0 - lr * weight_decay,
        "lr": lr,
        "inv_correction1": 1.0 / (1.0 - beta1**step) if beta1 else 1.0,
        "inv_correction2": 1.0 / math.sqrt(1.0 - beta2**step) if beta2 else 1.0,
        "step_size": -lr / (1.0 - beta1**step),
        "first": float(step == 1),
    }


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (through float64, exact for float32):
    torch's vectorized CPU sqrt can be one unit in the last place off, and every kernel
    must agree with the specification to the bit."""
    return torch.sqrt(x.double()).float()


def _step(name: str, g: torch.Tensor, p: torch.Tensor, states: list[torch.Tensor], h: dict[str, float]) -> torch.Tensor:
    """One update in float32, op by op (each op rounds): the new parameter; the new
    states replace ``states``' entries. ``g`` and ``p`` are float32 copies."""
    if name in ("momentum", "rmsprop", "adagrad") and h["decay"] > 0.0:
        g = g + p * h["decay"]
    if name in ("adam", "ademamix", "lion") and h["decay"] > 0.0:
        p = p * h["keep"]
    if name == "adam":
        m, v = states
        m = m * h["beta1"] + g * h["rest1"]
        v = v * h["beta2"] + (g * g) * h["rest2"]
        states[:] = [m, v]
        return p + (m / (_sqrt(v) * h["inv_correction2"] + h["eps"])) * h["step_size"]
    if name == "ademamix":
        m1, m2, v = states
        m1 = m1 * h["beta1"] + g * h["rest1"]
        m2 = m2 * h["beta3"] + g * h["rest3"]
        v = v * h["beta2"] + (g * g) * h["rest2"]
        states[:] = [m1, m2, v]
        mixed = m1 * h["inv_correction1"] + m2 * h["alpha"]
        return p - (mixed / (_sqrt(v) * h["inv_correction2"] + h["eps"])) * h["lr"]
    (s,) = states
    if name == "momentum":
        s = g if h["first"] else s * h["beta1"] + g
        states[:] = [s]
        return p - s * h["lr"]
    if name == "rmsprop":
        s = s * h["beta1"] + (g * g) * h["rest1"]
        states[:] = [s]
        return p - (g / (_sqrt(s) + h["eps"])) * h["lr"]
    if name == "adagrad":
        s = s + g * g
        states[:] = [s]
        return p - (g / (_sqrt(s) + h["eps"])) * h["lr"]
    mixed = s * h["beta1"] + g * h["rest1"]  # lion: the sign of the mix (0 for 0 and NaN)
    direction = (mixed > 0).float() - (mixed < 0).float()
    states[:] = [s * h["beta2"] + g * h["rest2"]]
    return p - direction * h["lr"]


def _split(name: str, state1: torch.Tensor, state2: torch.Tensor | None) -> list[torch.Tensor]:
    """The states one step reads, AdEMAMix's stacked first state as its two EMAs."""
    firsts = [state1[0], state1[1]] if name == "ademamix" else [state1]
    return [*firsts, *([state2] if state2 is not None else [])]


def _parts(
    name: str,
    state1: torch.Tensor,
    state2: torch.Tensor | None,
    absmax1: torch.Tensor,
    absmax2: torch.Tensor | None,
    qmap1: torch.Tensor,
    qmap2: torch.Tensor | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Each 8-bit state's (codes, absmax, map), in :func:`_split`'s order."""
    codes = _split(name, state1, state2)
    scales = [absmax1[0], absmax1[1]] if name == "ademamix" else [absmax1]
    maps = [qmap1] * len(scales)
    if state2 is not None:
        scales.append(absmax2)
        maps.append(qmap2)
    return codes, scales, maps


def _optimizer_update_32bit_reference(
    optimizer_name: str,
    g: torch.Tensor,
    p: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor | None,
    beta1: float,
    beta2: float,
    beta3: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    step: int,
    lr: float,
) -> None:
    h = _hyper(beta1, beta2, beta3, alpha, eps, weight_decay, step, lr)
    held = _split(optimizer_name, state1, state2)
    states = [s.clone() for s in held]
    new_p = _step(optimizer_name, g.float().clone(), p.float().clone(), states, h)
    for target, value in zip(held, states):
        target.copy_(value)
    p.copy_(new_p)


def _optimizer_update_8bit_blockwise_reference(
    optimizer_name: str,
    g: torch.Tensor,
    p: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor | None,
    absmax1: torch.Tensor,
    absmax2: torch.Tensor | None,
    qmap1: torch.Tensor,
    qmap2: torch.Tensor | None,
    beta1: float,
    beta2: float,
    beta3: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    step: int,
    lr: float,
) -> None:
    h = _hyper(beta1, beta2, beta3, alpha, eps, weight_decay, step, lr)
    codes, scales, maps = _parts(optimizer_name, state1, state2, absmax1, absmax2, qmap1, qmap2)
    states = [
        _dequantize_blockwise_reference(c, a, m, OPTIMIZER_BLOCKSIZE, torch.float32)
        for c, a, m in zip(codes, scales, maps)
    ]
    new_p = _step(optimizer_name, g.float().clone(), p.float().clone(), states, h)
    for code, scale, table, value in zip(codes, scales, maps, states):
        q, new_scale = _quantize_blockwise_reference(value, table, OPTIMIZER_BLOCKSIZE)
        code.copy_(q)
        scale.copy_(new_scale)
    p.copy_(new_p)


def _fake(*args: Any) -> None:
    return None


# -- checks (D9): metadata and Python numbers, never tensor values -----------------------


def _check_number(name: str, value: object, low: float, high: float, *, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}: {value!r}")
    if not (low <= value < high if high_open else low <= value <= high):
        accepted = f"a float in [{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}={value!r} is not accepted; accepted: {accepted}")


def _check_scalars(
    optimizer_name: object,
    beta1: object,
    beta2: object,
    beta3: object,
    alpha: object,
    eps: object,
    weight_decay: object,
    step: object,
    lr: object,
) -> None:
    check_type("optimizer_name", optimizer_name, str)
    check_choice("optimizer_name", optimizer_name, OPTIMIZERS)
    for name, value in (("beta1", beta1), ("beta2", beta2), ("beta3", beta3)):
        _check_number(name, value, 0.0, 1.0, high_open=True)
    for name, value in (("alpha", alpha), ("eps", eps), ("weight_decay", weight_decay), ("lr", lr)):
        _check_number(name, value, 0.0, math.inf, high_open=True)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step being taken, counted from 1), got {step!r}")


def _check_param(g: object, p: object) -> tuple[torch.Tensor, torch.Tensor]:
    check_type("p", p, torch.Tensor)
    check_type("g", g, torch.Tensor)
    check_choice("p.dtype", p.dtype, FLOAT_DTYPES)
    if g.dtype != p.dtype or g.shape != p.shape:
        raise ValueError(
            f"g must match p: got g {g.dtype} {tuple(g.shape)}, p {p.dtype} {tuple(p.shape)}; accepted: the same "
            f"dtype and shape"
        )
    check_same_device("g", g, "p", p)
    if not p.is_contiguous():
        raise ValueError("p must be contiguous: the update writes it in place value by value")
    return g, p


def _check_state(name: str, state: object, p: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    check_type(name, state, torch.Tensor)
    if state.dtype != dtype or tuple(state.shape) != shape:
        raise ValueError(
            f"{name} must be {dtype} of shape {shape} for p of shape {tuple(p.shape)}, got {state.dtype} "
            f"{tuple(state.shape)}"
        )
    check_same_device(name, state, "p", p)
    if not state.is_contiguous():
        raise ValueError(f"{name} must be contiguous: the update writes it in place")


def _check_second(optimizer_name: str, state2: object) -> bool:
    """Whether the optimizer has a second state; a second state given to one that has none,
    or none given to one that needs it, is refused."""
    two = optimizer_name in TWO_STATE_OPTIMIZERS
    if two and state2 is None:
        raise ValueError(f"optimizer_name={optimizer_name!r} needs state2 (its second moment); got None")
    if not two and state2 is not None:
        raise ValueError(f"optimizer_name={optimizer_name!r} has one state; state2 must be None")
    return two


def _first_shape(optimizer_name: str, p: torch.Tensor) -> tuple[int, ...]:
    return (2, *p.shape) if optimizer_name == "ademamix" else tuple(p.shape)


def _check_32bit(optimizer_name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, weight_decay, step, lr) -> None:
    _check_scalars(optimizer_name, beta1, beta2, beta3, alpha, eps, weight_decay, step, lr)
    g, p = _check_param(g, p)
    _check_state("state1", state1, p, torch.float32, _first_shape(optimizer_name, p))
    if _check_second(optimizer_name, state2):
        _check_state("state2", state2, p, torch.float32, tuple(p.shape))


def _check_map(name: str, qmap: object, p: torch.Tensor) -> None:
    check_type(name, qmap, torch.Tensor)
    if qmap.dtype != torch.float32 or qmap.dim() != 1 or qmap.numel() != 256:
        raise ValueError(
            f"{name} must be a 1-D float32 tensor of 256 values (the code the state's bytes index), got "
            f"{qmap.dtype} {tuple(qmap.shape)}"
        )
    check_same_device(name, qmap, "p", p)


def _check_8bit(*args) -> None:
    """The 8-bit update's arguments, in the op's order (a wrong count is the schema's error)."""
    optimizer_name, g, p, state1, state2, absmax1, absmax2, qmap1, qmap2, *scalars = args
    beta1, beta2, beta3, alpha, eps, weight_decay, step, lr = scalars
    _check_scalars(optimizer_name, beta1, beta2, beta3, alpha, eps, weight_decay, step, lr)
    g, p = _check_param(g, p)
    first = _first_shape(optimizer_name, p)
    blocks = block_count(p.numel(), OPTIMIZER_BLOCKSIZE)
    _check_state("state1", state1, p, torch.uint8, first)
    _check_state("absmax1", absmax1, p, torch.float32, (2, blocks) if optimizer_name == "ademamix" else (blocks,))
    _check_map("qmap1", qmap1, p)
    if _check_second(optimizer_name, state2):
        _check_state("state2", state2, p, torch.uint8, tuple(p.shape))
        _check_state("absmax2", absmax2, p, torch.float32, (blocks,))
        _check_map("qmap2", qmap2, p)
    elif absmax2 is not None or qmap2 is not None:
        raise ValueError(f"optimizer_name={optimizer_name!r} has one state; absmax2 and qmap2 must be None")


# -- CPU kernels ----------------------------------------------------------------------------


def _update_32bit_cpu(*args) -> None:
    optimizer_name, g, p, state1, state2, *scalars = args
    _cpu.update_32bit_cpu(
        optimizer_name,
        g,
        p,
        _split(optimizer_name, state1, state2),
        _hyper(*scalars),
        lambda: _optimizer_update_32bit_reference(*args),
    )


def _update_8bit_cpu(*args) -> None:
    optimizer_name, g, p, state1, state2, absmax1, absmax2, qmap1, qmap2, *scalars = args
    blockwise._check_sorted(qmap1, p.device, "qmap1")
    if qmap2 is not None:
        blockwise._check_sorted(qmap2, p.device, "qmap2")
    codes, scales, maps = _parts(optimizer_name, state1, state2, absmax1, absmax2, qmap1, qmap2)
    _cpu.update_8bit_cpu(
        optimizer_name,
        g,
        p,
        codes,
        scales,
        maps,
        OPTIMIZER_BLOCKSIZE,
        _hyper(*scalars),
        lambda: _optimizer_update_8bit_blockwise_reference(*args),
    )


# -- GPU kernels (Triton) -------------------------------------------------------------------


def _triton():
    return importlib.import_module("tightfit.ops._triton_optimizer")


def _map_search(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The search tables of a state's map: built once per device for the dynamic maps the
    optimizers share; built from the values (a device sync) for any other map."""
    for name in ("dynamic", "udynamic"):
        if qmap is blockwise._code_on(name, qmap.device):
            return blockwise._named_search(name, qmap.device)
    blockwise._check_sorted(qmap, qmap.device, "the state's map")
    return blockwise._triton().search_tables(qmap, qmap.device)


def _update_32bit_gpu(*args) -> None:
    optimizer_name, g, p, state1, state2, *scalars = args
    _triton().update_32bit(
        OPTIMIZERS.index(optimizer_name), g, p, _split(optimizer_name, state1, state2), _hyper(*scalars), _cpu.CONSTANTS
    )


def _update_8bit_gpu(*args) -> None:
    optimizer_name, g, p, state1, state2, absmax1, absmax2, qmap1, qmap2, *scalars = args
    codes, scales, maps = _parts(optimizer_name, state1, state2, absmax1, absmax2, qmap1, qmap2)
    searches = [_map_search(m) for m in maps]
    if not all(single for _, _, single in searches):
        report_fallback(
            "optimizer_update_8bit_blockwise",
            p.device.type,
            "reference",
            "a state map with several code boundaries in one search bucket runs the reference kernel",
        )
        _optimizer_update_8bit_blockwise_reference(*args)
        return
    _triton().update_8bit(
        OPTIMIZERS.index(optimizer_name), g, p, codes, scales, searches, maps, _hyper(*scalars), _cpu.CONSTANTS
    )


# -- conformance cases ----------------------------------------------------------------------

#: (step, weight decay) pairs each case runs: the first step (momentum's special case,
#: the bias corrections' largest) without decay, a later one with it.
_CASE_STEPS = ((1, 0.0), (7, 0.01))
_CASE_NUMEL = 3 * OPTIMIZER_BLOCKSIZE + 37  # full blocks and a partial one


def _case_hyper(name: str) -> tuple[float, float, float, float, float]:
    """(beta1, beta2, beta3, alpha, eps) as bitsandbytes' optimizers default them."""
    return {
        "adam": (0.9, 0.999, 0.0, 0.0, 1e-8),
        "ademamix": (0.9, 0.999, 0.9999, 5.0, 1e-8),
        "momentum": (0.9, 0.0, 0.0, 0.0, 0.0),
        "rmsprop": (0.99, 0.0, 0.0, 0.0, 1e-8),
        "adagrad": (0.0, 0.0, 0.0, 0.0, 1e-10),
        "lion": (0.9, 0.99, 0.0, 0.0, 0.0),
    }[name]


def _case_states(name: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 states mid-training: first moments signed and small, second ones positive."""
    first = torch.randn(_first_shape(name, torch.empty(_CASE_NUMEL)), generator=generator) * 0.01
    second = torch.rand(_CASE_NUMEL, generator=generator) * 1e-4 if name in TWO_STATE_OPTIMIZERS else None
    if name in ("rmsprop", "adagrad"):
        first = first.abs()  # a running sum of squares
    return first, second


def _optimizer_cases(eight_bit: bool) -> list[Case]:
    cases = []
    generator = torch.Generator().manual_seed(0)
    for name in OPTIMIZERS:
        beta1, beta2, beta3, alpha, eps = _case_hyper(name)
        for dtype in FLOAT_DTYPES:
            for step, decay in _CASE_STEPS:
                p = torch.randn(_CASE_NUMEL, generator=generator).to(dtype)
                g = (torch.randn(_CASE_NUMEL, generator=generator) * 0.1).to(dtype)
                first, second = _case_states(name, generator)
                scalars = (beta1, beta2, beta3, alpha, eps, decay, step, 1e-3)
                label = f"{name} {dtype} step {step} decay {decay}"
                if not eight_bit:
                    cases.append(Case(label, (name, g, p, first, second, *scalars)))
                    continue
                signed, unsigned = dynamic_map(), dynamic_map(signed=False)
                coded = [
                    _quantize_blockwise_reference(row, signed, OPTIMIZER_BLOCKSIZE)
                    for row in first.reshape(-1, _CASE_NUMEL)
                ]
                state1 = torch.stack([c for c, _ in coded]).reshape(first.shape)
                absmax1 = torch.stack([a for _, a in coded])
                absmax1 = absmax1 if name == "ademamix" else absmax1[0]
                state2 = absmax2 = qmap2 = None
                if second is not None:
                    state2, absmax2 = _quantize_blockwise_reference(second, unsigned, OPTIMIZER_BLOCKSIZE)
                    qmap2 = unsigned
                cases.append(Case(label, (name, g, p, state1, state2, absmax1, absmax2, signed, qmap2, *scalars)))
    return cases


_UPDATE_32BIT = define_op(
    "optimizer_update_32bit",
    _optimizer_update_32bit_reference,
    fake=_fake,
    cases=lambda: _optimizer_cases(eight_bit=False),
    mutates_args=("p", "state1", "state2"),
    check=_check_32bit,
)
_UPDATE_8BIT = define_op(
    "optimizer_update_8bit_blockwise",
    _optimizer_update_8bit_blockwise_reference,
    fake=_fake,
    cases=lambda: _optimizer_cases(eight_bit=True),
    mutates_args=("p", "state1", "state2", "absmax1", "absmax2"),
    check=_check_8bit,
)
register_kernel("optimizer_update_32bit", "cpu", _update_32bit_cpu, label="fused pass (numba)")
register_kernel("optimizer_update_8bit_blockwise", "cpu", _update_8bit_cpu, label="fused block pass (numba)")
if importlib.util.find_spec("triton") is not None:  # checked without importing it (D2)
    register_kernel("optimizer_update_32bit", "cuda", _update_32bit_gpu, label="fused tiles (triton)")
    register_kernel("optimizer_update_8bit_blockwise", "cuda", _update_8bit_gpu, label="fused block tiles (triton)")


# -- public functions ----------------------------------------------------------------------


def optimizer_update_32bit(
    optimizer_name: str,
    g: torch.Tensor,
    p: torch.Tensor,
    state1: torch.Tensor,
    state2: torch.Tensor | None = None,
    *,
    beta1: float,
    beta2: float = 0.0,
    beta3: float = 0.0,
    alpha: float = 0.0,
    eps: float = 0.0,
    weight_decay: float = 0.0,
    step: int,
    lr: float,
) -> None:
    """One step of ``optimizer_name`` (:data:`OPTIMIZERS`) on ``p`` in place, with float32
    states ``state1`` (AdEMAMix: its two EMAs stacked, ``(2, *p.shape)``) and ``state2``
    (Adam and AdEMAMix only) updated in place. ``step`` counts from 1."""
    _UPDATE_32BIT(optimizer_name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, weight_decay, step, lr)


def optimizer_update_8bit_blockwise(
    optimizer_name: str,
    g: torch.Tensor,
    p: torch.Tensor,
    state1: torch.Tensor,
    absmax1: torch.Tensor,
    qmap1: torch.Tensor,
    state2: torch.Tensor | None = None,
    absmax2: torch.Tensor | None = None,
    qmap2: torch.Tensor | None = None,
    *,
    beta1: float,
    beta2: float = 0.0,
    beta3: float = 0.0,
    alpha: float = 0.0,
    eps: float = 0.0,
    weight_decay: float = 0.0,
    step: int,
    lr: float,
) -> None:
    """One step of ``optimizer_name`` on ``p`` in place with 8-bit blockwise states: codes
    ``state1`` / ``state2`` (uint8, shaped like ``p``; AdEMAMix's ``state1`` ``(2, *p.shape)``)
    into maps ``qmap1`` / ``qmap2`` with float32 ``absmax1`` / ``absmax2`` per block of
    :data:`OPTIMIZER_BLOCKSIZE`, all updated in place. Non-finite values in the result are
    not refused here (that would cost a sync per step): the optimizers check loaded state."""
    _UPDATE_8BIT(
        optimizer_name,
        g,
        p,
        state1,
        state2,
        absmax1,
        absmax2,
        qmap1,
        qmap2,
        beta1,
        beta2,
        beta3,
        alpha,
        eps,
        weight_decay,
        step,
        lr,
    )
