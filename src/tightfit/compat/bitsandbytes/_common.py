"""What the package's modules share: argument checks in the manner of D7 (name, value,
what is accepted) and :func:`fixed_argument`, which builds bitsandbytes' ``*_nf4`` /
``*_fp4`` shorthands from the full function or layer. Private."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from tightfit._validate import check_type

__all__: list[str] = []  # private helpers


def check_out(name: str, out: object, shape: tuple[int, ...], dtype: torch.dtype, A: torch.Tensor) -> None:
    """A caller's output tensor must take the result as it is: checked before any work, so a
    refusal leaves it untouched and an accepted one is written whole."""
    if out is None:
        return
    check_type(name, out, torch.Tensor)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != A.device:
        raise ValueError(
            f"{name} must be {dtype} of shape {tuple(shape)} on {A.device} (A's device), "
            f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
        )


def check_optional_tensor(name: str, value: object) -> None:
    if value is not None:
        check_type(name, value, torch.Tensor)


def check_bias(bias: object, features: int, A: torch.Tensor) -> None:
    """A product's ``bias``: None, or a float tensor of shape ``(features,)`` on ``A``'s device
    (torch would broadcast other shapes into a result of another shape, or fail inside)."""
    if bias is None:
        return
    check_type("bias", bias, torch.Tensor)
    if tuple(bias.shape) != (features,) or not bias.is_floating_point() or bias.device != A.device:
        raise ValueError(
            f"bias must be a float tensor of shape ({features},) on {A.device} (A's device), "
            f"got {bias.dtype} of shape {tuple(bias.shape)} on {bias.device}"
        )


def check_size(name: str, value: object, minimum: int) -> int:
    """A layer's dimension: an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be int, got {type(value).__name__}: {value!r:.80}")
    if value < minimum:
        raise ValueError(f"{name}={value} is not accepted; accepted: an int >= {minimum}")
    return value


def check_indices(input: object, count: int) -> None:
    """Integer indices below ``count``: an index out of range is an error here, not a
    device-side assert in the lookup (which leaves a GPU context unusable)."""
    check_type("input", input, torch.Tensor)
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input has dtype {input.dtype}; accepted: torch.int64, torch.int32 (indices)")
    if input.numel():
        low, high = (int(value) for value in torch.aminmax(input))
        if low < 0 or high >= count:
            raise ValueError(f"input holds index {low if low < 0 else high}; accepted: 0 to {count - 1}")


def fixed_argument(full: Callable[..., Any], name: str, value: object, *, qualname: str) -> Callable[..., Any]:
    """``full`` with its parameter ``name`` fixed to ``value`` and removed from the signature,
    as the function ``qualname`` (``"quantize_nf4"``, ``"LinearNF4.__init__"``).

    bitsandbytes' shorthands (``quantize_nf4``, ``LinearNF4``, ...) take the full one's
    other parameters in the same order, so a positional call written for bitsandbytes binds
    the same way here; passing ``name`` itself is a TypeError, as there."""
    signature = inspect.signature(full)
    signature = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != name])

    def shorthand(*args: Any, **kwargs: Any) -> Any:
        return full(**signature.bind(*args, **kwargs).arguments, **{name: value})

    shorthand.__signature__ = signature
    shorthand.__module__ = full.__module__
    shorthand.__qualname__ = qualname
    shorthand.__name__ = qualname.rpartition(".")[2]
    shorthand.__doc__ = f"``{full.__qualname__}`` with ``{name}={value!r}``."
    return shorthand
