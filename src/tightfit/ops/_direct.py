"""Decoding's path past the dispatcher on the CPU.

A decoding step calls each linear layer once for one token. Through the op (its argument
check, torch.library's dispatch, the preparation of scales and pointers) such a call cost
40-60 µs above the kernel on a 2-core Xeon: several times the kernel's own work on a small
weight, a sixth of a 0.46B model's step. So a quantized layer's few-token forward calls its
native kernel bound once to its weight (:class:`tightfit.ops._cpu_gemv.BoundKernel`), where
the dispatcher would add nothing: a plain CPU tensor in a dtype the kernels read, no
gradient to record, no dispatch or function mode active (memory measurement, fake tensors),
not tracing (torch.compile, export). Everywhere else the op runs; both call the same kernel
with the same arguments, so the bits are the same.

The layer's own checks (its input's width; its weight and scales, checked when they were
made or loaded) stand for the op's: a binding is used only while every tensor it was bound
from is still the layer's, at the same address, shape, stride and dtype. It holds them
weakly, so a weight that an offloading hook drops is freed as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from tightfit.ops._native import DTYPE_CODES

__all__: list[str] = []

#: Rows up to which a forward takes a bound kernel (the few-token kernels' own limit).
DIRECT_ROWS = 8


def direct_rows(x: torch.Tensor, in_features: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x``'s rows as a 2-D view where a bound kernel may run for them, else None."""
    if (
        torch.compiler.is_compiling()  # first: what follows does not trace
        or type(x) is not torch.Tensor
        or x.device.type != "cpu"
        or x.dtype not in DTYPE_CODES
        or not x.is_contiguous()
        or in_features == 0
        or torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
        or torch._C._functorch.is_functorch_wrapped_tensor(x)
        or (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))
    ):
        return None
    rows = x.numel() // in_features
    return x.view(rows, in_features) if 0 < rows <= DIRECT_ROWS else None


def _fingerprint(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


class LayerBinding:
    """One layer's bound kernel, bound again when a tensor it came from is no longer the
    layer's (a weight loaded or replaced, the layer moved or offloaded) or has changed, or
    when a setting it was bound with has. Copies of a layer start unbound."""

    __slots__ = ("_sources", "_settings", "_kernel")

    def __init__(self) -> None:
        self._sources: tuple = ()
        self._settings: tuple = ()
        self._kernel = None

    def __reduce__(self) -> tuple:
        return LayerBinding, ()

    def __deepcopy__(self, memo: dict) -> LayerBinding:
        return LayerBinding()

    def kernel(self, sources: Sequence[torch.Tensor], settings: tuple, bind: Callable[[], object]):
        """The kernel bound from ``sources`` with ``settings`` (calling ``bind`` where it is
        not current), or None where ``bind`` gave none (no native build: the op runs, and
        reports it)."""
        current = (
            settings == self._settings
            and len(sources) == len(self._sources)
            and all(
                ref() is tensor and fingerprint == _fingerprint(tensor)
                for (ref, fingerprint), tensor in zip(self._sources, sources)
            )
        )
        if not current:
            self._kernel = bind()
            self._sources = tuple((weakref.ref(tensor), _fingerprint(tensor)) for tensor in sources)
            self._settings = settings
        return self._kernel


def binding_of(module: torch.nn.Module) -> LayerBinding:
    """``module``'s binding, made at its first direct call."""
    binding = module.__dict__.get("_tightfit_binding")
    if binding is None:
        binding = module.__dict__["_tightfit_binding"] = LayerBinding()
    return binding


def with_bias(result: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The few-token ops' bias: added to the result and rounded once, as torch.compile computes it."""
    return result if bias is None else (result + bias).to(dtype)


def not_held(tensors: Sequence[torch.Tensor], held: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Of ``tensors`` (what a kernel's pointers point into), those that share no storage with
    ``held`` (tensors the caller keeps alive itself): what a bound kernel must hold."""
    shared = {tensor.untyped_storage().data_ptr() for tensor in held}
    return [tensor for tensor in tensors if tensor.untyped_storage().data_ptr() not in shared]
