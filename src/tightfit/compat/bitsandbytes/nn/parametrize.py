"""``bitsandbytes.nn.parametrize`` on tightfit: 4-bit storage for any parameter of any module
(MoE expert tensors, 3-D weights), outside ``nn.Linear``.

``from tightfit.compat.bitsandbytes.nn.parametrize import replace_parameter_4bit`` in place
of bitsandbytes'. The parameter keeps bitsandbytes' packed codes and a torch parametrization
decodes them on access. The state dict holds the codes under the parameter's own name plus
the QuantState entries (``<name>.absmax``, ``<name>.quant_state.bitsandbytes__nf4``, ...),
the layout bitsandbytes writes; as there, loading that dict back is the caller's work
(:func:`replace_parameter_4bit_prequantized`). During a module's forward the decoded value is
cached (torch's ``parametrize.cached``), so a parameter read several times decodes once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.utils.parametrize as P
from torch import nn

from tightfit._validate import check_type
from tightfit.compat.bitsandbytes import functional as F
from tightfit.ops._arg_checks import packed_bytes
from tightfit.quant import functional as QF

__all__ = ["Bnb4bitParametrization", "replace_parameter_4bit", "replace_parameter_4bit_prequantized"]


class Bnb4bitParametrization(nn.Module):
    """Decodes a parameter's packed 4-bit codes with ``quant_state``, in the state's shape and
    dtype. tightfit's decode, not the compat one: that (as bitsandbytes') reads codes shaped
    (1, n) as a transposed weight, which turned a 2-element parameter such as
    ``nn.Linear(2, 1).weight`` (codes (1, 1)) into shape (2, 1) in bitsandbytes."""

    def __init__(self, quant_state: F.QuantState) -> None:
        super().__init__()
        check_type("quant_state", quant_state, F.QuantState)
        self.quant_state = quant_state

    @torch.no_grad()
    def forward(self, quantized_param: torch.Tensor) -> torch.Tensor:
        return QF.dequantize_4bit(quantized_param, self.quant_state)


def _original_parameter(module: object, param_name: object) -> nn.Parameter:
    """bitsandbytes' two refusals (AttributeError, TypeError), with what was found."""
    check_type("module", module, nn.Module)
    check_type("param_name", param_name, str)
    if not hasattr(module, param_name):
        names = ", ".join(name for name, _ in module.named_parameters(recurse=False)) or "none"
        raise AttributeError(
            f"Module does not have parameter '{param_name}' ({type(module).__name__} has parameters: {names})"
        )
    value = getattr(module, param_name)
    if not isinstance(value, nn.Parameter):
        raise TypeError(f"Parameter '{param_name}' is not an instance of nn.Parameter (got {type(value).__name__})")
    return value


def replace_parameter_4bit(
    module: nn.Module,
    param_name: str,
    compress_statistics: bool = False,
    quant_type: str = "nf4",
    blocksize: int | None = None,
) -> None:
    """Quantize ``module.<param_name>`` to 4-bit (NF4 or FP4) in place; reading it decodes.

    The parameter becomes the packed codes (``requires_grad=False``), so the module holds
    about an eighth of the float32 bytes; the decoded value requires no gradient.
    """
    original = _original_parameter(module, param_name)
    packed, quant_state = F.quantize_4bit(
        original.data, blocksize=blocksize, compress_statistics=compress_statistics, quant_type=quant_type
    )
    setattr(module, param_name, nn.Parameter(packed, requires_grad=False))
    _parametrize(module, param_name, quant_state)


def replace_parameter_4bit_prequantized(
    module: nn.Module, param_name: str, qs_dict: dict[str, Any], device: torch.device | str
) -> None:
    """Decode ``module.<param_name>``, which already holds packed 4-bit codes (a checkpoint's),
    with the QuantState in ``qs_dict`` (``QuantState.as_dict`` output, packed or not), built on
    ``device``. The dict is checked as every checkpoint read is; the codes must be as many
    bytes as the state's shape needs."""
    original = _original_parameter(module, param_name)
    check_type("qs_dict", qs_dict, dict)
    quant_state = F.QuantState.from_dict(qs_dict, device=device)
    if quant_state.quant_type is None or quant_state.shape is None:
        raise ValueError(
            f"qs_dict must describe a 4-bit (nf4 / fp4) tensor with its shape, got quant_type="
            f"{quant_state.quant_type!r}, shape={quant_state.shape}"
        )
    needed = packed_bytes(quant_state.shape.numel())
    if original.nbytes != needed:
        raise ValueError(
            f"module.{param_name} must hold the {needed} bytes of packed codes for shape "
            f"{tuple(quant_state.shape)}, got {original.dtype} of shape {tuple(original.shape)} ({original.nbytes} bytes)"
        )
    _parametrize(module, param_name, quant_state)


def _parametrize(module: nn.Module, param_name: str, quant_state: F.QuantState) -> None:
    # unsafe: the parametrization's output (float, the state's shape) differs from the codes it reads
    P.register_parametrization(module, param_name, Bnb4bitParametrization(quant_state), unsafe=True)
    module.register_state_dict_post_hook(functools.partial(_state_dict_as_bitsandbytes, param_name=param_name))
    cache = _CachedDuringForward()
    module.register_forward_pre_hook(cache.enter)
    # always_call: checkpointing's early stop aborts a recompute mid-forward; the cache must still close
    module.register_forward_hook(cache.exit, always_call=True)


class _CachedDuringForward:
    """Holds torch's ``parametrize.cached()`` open for the length of one forward (one per call)."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    def enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        context = P.cached()
        context.__enter__()
        self._open.append(context)

    def exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._open:  # empty when an earlier pre-hook raised before enter ran
            self._open.pop().__exit__(None, None, None)


def _state_dict_as_bitsandbytes(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *, param_name: str
) -> None:
    """``parametrizations.<name>.original`` -> ``<name>``, plus the QuantState's packed entries."""
    original_key = f"{prefix}parametrizations.{param_name}.original"
    if original_key not in state_dict:
        return
    state_dict[prefix + param_name] = state_dict.pop(original_key)
    for parametrization in module.parametrizations[param_name]:
        if isinstance(parametrization, Bnb4bitParametrization):
            for key, value in parametrization.quant_state.as_dict(packed=True).items():
                state_dict[f"{prefix}{param_name}.{key}"] = value
