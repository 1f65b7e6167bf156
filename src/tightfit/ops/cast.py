"""``tightfit.ops.cast``: storage casts between the float8 kinds and bf16 / fp16 / fp32.

Results are bit-identical to torch's own conversion (``Tensor.to``), which is the
reference kernel; the CPU kernel is a table lookup that runs at memory speed.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from tightfit._validate import check_choice, check_same_device, check_type
from tightfit.backends.base import FLOAT8_DTYPES
from tightfit.ops._cpu_cast import MIN_FAST_NUMEL, cast_cpu, cast_into_cpu
from tightfit.ops._registry import Case, define_op, register_kernel

__all__ = ["cast", "CAST_DTYPES"]

#: dtypes ``cast`` reads and writes.
CAST_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16}) | FLOAT8_DTYPES


def _cast_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _cast_fake(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def _cast_into_reference(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


def _cast_into_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


def _cast_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    """Straight through: the gradient goes back in the input's dtype."""
    return grad.to(ctx.input_dtype), None


def _cast_setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.input_dtype = inputs[0].dtype


# -- conformance cases ---------------------------------------------------------------

_MAIN_FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
_OTHER_FLOAT8 = sorted(FLOAT8_DTYPES - set(_MAIN_FLOAT8), key=str)
_WIDE = [torch.float32, torch.float16, torch.bfloat16]


def _every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """All bit patterns of an 8- or 16-bit dtype (NaN, inf, subnormals, both zeros)."""
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


def _float32_probe_values() -> torch.Tensor:
    """float32 values on and next to every float8 rounding boundary, specials, random bits."""
    bf16_exact = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int64) << 16
    neighbours = [bf16_exact + delta for delta in (0, -1, 1, 1 << 14, (1 << 15) - 1, 1 << 15, (1 << 15) + 1)]
    generator = torch.Generator().manual_seed(0)
    random = torch.randint(0, 1 << 32, (1 << 16,), generator=generator, dtype=torch.int64)
    bits = (torch.cat([*neighbours, random]) & 0xFFFFFFFF).to(torch.int32)  # wraps to the bit pattern
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, 464.0, 480.0, 57344.0, 61440.0]
        + [2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 1e-45]
    )
    return torch.cat([bits.view(torch.float32), specials])


def _source(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * 64).to(dtype)


def _cast_cases() -> list[Case]:
    cases = []
    for target in _MAIN_FLOAT8:
        for source in _WIDE:
            values = _float32_probe_values() if source == torch.float32 else _every_pattern(source)
            cases.append(Case(f"{source}->{target} all-edges", (values, target)))
        for source in _MAIN_FLOAT8:
            cases.append(Case(f"{source}->{target} all-patterns", (_every_pattern(source), target)))
    for source in _MAIN_FLOAT8 + _OTHER_FLOAT8:
        for target in _WIDE:
            cases.append(Case(f"{source}->{target} all-patterns", (_every_pattern(source), target)))
    for target in _OTHER_FLOAT8:
        cases.append(Case(f"torch.bfloat16->{target} all-patterns", (_every_pattern(torch.bfloat16), target)))
    shapes = {"empty": (0,), "scalar": (), "one": (1,), "odd": (MIN_FAST_NUMEL + 3,), "3d": (7, 5, 3)}
    for label, shape in shapes.items():
        numel = int(torch.Size(shape).numel())
        for source, target in [(torch.float8_e4m3fn, torch.bfloat16), (torch.float32, torch.float8_e5m2)]:
            cases.append(Case(f"{source}->{target} {label}", (_source(source, numel, 1).reshape(shape), target)))
    strided = _source(torch.float8_e4m3fn, 2 * (MIN_FAST_NUMEL + 5), 2).reshape(-1, 2)
    cases.append(Case("float8_e4m3fn->bf16 transposed", (strided.t(), torch.bfloat16)))
    cases.append(
        Case(
            "bf16->float8_e4m3fn every-other",
            (_source(torch.bfloat16, 2 * MIN_FAST_NUMEL + 2, 3)[::2], torch.float8_e4m3fn),
        )
    )
    return cases


def _cast_into_cases() -> list[Case]:
    return [
        Case(case.name, (case.args[0], torch.empty(case.args[0].shape, dtype=case.args[1]))) for case in _cast_cases()
    ]


def _check_cast(x: object, dtype: object) -> None:
    check_type("x", x, torch.Tensor)
    check_type("dtype", dtype, torch.dtype)
    check_choice("x.dtype", x.dtype, CAST_DTYPES)
    check_choice("dtype", dtype, CAST_DTYPES)


def _has_data(tensor: torch.Tensor) -> bool:
    """False for the fake and meta tensors of a trace, which have shapes but no memory."""
    return tensor.device.type != "meta" and not is_fake(tensor)


def _check_cast_into(x: object, out: object) -> None:
    check_type("out", out, torch.Tensor)
    _check_cast(x, out.dtype)
    if out.shape != x.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but x has shape {tuple(x.shape)}; they must match")
    check_same_device("out", out, "x", x)
    if out.numel() and _has_data(out) and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        raise ValueError("out shares its storage with x; pass a separate buffer")


_CAST = define_op("cast", _cast_reference, fake=_cast_fake, cases=_cast_cases, check=_check_cast)
_CAST.custom_op.register_autograd(_cast_backward, setup_context=_cast_setup_context)
_CAST_INTO = define_op(
    "cast_into",
    _cast_into_reference,
    fake=_cast_into_fake,
    cases=_cast_into_cases,
    mutates_args=("out",),
    check=_check_cast_into,
)
register_kernel("cast", "cpu", cast_cpu, label="table lookup (numba)")
register_kernel("cast_into", "cpu", cast_into_cpu, label="table lookup (numba)")
# Accelerators' own cast kernels are vectorized already: the reference is their fast kernel.
for _device_type in ("cuda", "xpu", "hpu", "mps"):
    register_kernel("cast", _device_type, _cast_reference, label="torch native cast")
    register_kernel("cast_into", _device_type, _cast_into_reference, label="torch native cast")


def cast(x: torch.Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Cast ``x`` to ``dtype``, rounding exactly as torch does; one side is usually float8.

    Accepts float32, float16, bfloat16 and every float8 kind of this torch. With ``out``
    (same shape, dtype ``dtype``, same device) the result is written there and returned,
    so a layer can reuse one buffer. The result is contiguous. Gradients pass straight
    through, back in ``x``'s dtype.
    """
    if out is None:
        return _CAST(x, dtype)
    check_type("out", out, torch.Tensor)
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype} but dtype={dtype}; they must match")
    if out.requires_grad:
        raise ValueError("out requires grad; cast(..., out=) writes in place, which autograd cannot follow")
    _CAST_INTO(x, out)
    return out
