"""Decoding's path past the dispatcher, on the CPU and on CUDA GPUs.

A decoding step calls each linear layer once for one token. Through the op (its argument
check, torch.library's dispatch, the preparation of scales and pointers) such a call cost
40-60 µs above the kernel on a 2-core Xeon: several times the kernel's own work on a small
weight, a sixth of a 0.46B model's step. So a quantized layer's few-token forward calls its
native kernel bound once to its weight (:class:`tightfit.ops._cpu_gemv.BoundKernel`), where
the dispatcher would add nothing: a plain CPU tensor in a dtype the kernels read, no
gradient to record, no dispatch or function mode active (memory measurement, fake tensors),
not tracing (torch.compile, export). Everywhere else the op runs; both call the same kernel
with the same arguments, so the bits are the same. On a CUDA GPU the bound kernel is the op's
own Triton kernel, called with the layer's tensors as they are at each call (held through a
weak reference to the layer): what it skips is the op's argument check and dispatch, the
host work that decides a small model's decoding speed there.

A binding is made only after the op's own check of the layer's tensors (a layer's attributes
can be set to anything: a hook's swap, a user's assignment) and only for plain tensors on
the input's device; where either fails the op runs and raises its error. It is used only while
every tensor it was bound from is still the layer's, at the same address, shape, stride and
dtype, and the layer's settings are the same. It holds the tensors weakly, so a weight that
an offloading hook drops is freed as before.
"""

from __future__ import annotations

import importlib.util
import weakref
from collections.abc import Callable, Sequence

import torch

from tightfit.ops._native import DTYPE_CODES

__all__: list[str] = []

#: Rows up to which a forward takes a bound kernel (the few-token kernels' own limit).
DIRECT_ROWS = 8


#: Device types whose few-token kernels a layer may bind: the CPU's native ones, and CUDA's
#: Triton ones where Triton is installed (found without importing it, D2).
DIRECT_DEVICE_TYPES = ("cpu", "cuda") if importlib.util.find_spec("triton") is not None else ("cpu",)


def direct_rows(
    x: torch.Tensor, in_features: int, bias: torch.Tensor | None, device_types: Sequence[str] = ("cpu",)
) -> torch.Tensor | None:
    """``x``'s rows as a 2-D view where a bound kernel may run for them (``x`` on one of
    ``device_types``, those the caller has kernels for), else None."""
    if (
        torch.compiler.is_compiling()  # first: what follows does not trace
        or type(x) is not torch.Tensor
        or x.device.type not in device_types
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


def plain_on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor``'s data pointer is memory on ``device`` a kernel may read: a plain
    tensor (or parameter) there, not a fake or other subclass whose pointer is not its data."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.device == device
        and not torch._subclasses.fake_tensor.is_fake(tensor)
    )


_CPU = torch.device("cpu")


def passes_op_check(tensors: Sequence[torch.Tensor], check: Callable[[], object], device: torch.device = _CPU) -> bool:
    """Whether a kernel may be bound to ``tensors``: all :func:`plain_on` ``device``, and the
    op's own argument ``check`` raises nothing (where it would, the op runs and raises it)."""
    if not all(plain_on(tensor, device) for tensor in tensors):
        return False
    try:
        check()
    except (TypeError, ValueError):
        return False
    return True


class LayerBinding:
    """One layer's bound kernel, bound again when a tensor it came from is no longer the
    layer's (a weight loaded or replaced, the layer moved or offloaded) or has changed, or
    when a setting it was bound with has. Copies of a layer start unbound. The settings,
    sources and kernel are one tuple, replaced whole, so a thread reads a consistent one."""

    __slots__ = ("_bound",)

    def __init__(self) -> None:
        self._bound: tuple = ((), (), None)  # settings, (weakref, fingerprint) per source, kernel

    @property
    def bound(self) -> object:
        """What the last binding gave: the kernel (a layer's own marker, for LLM.int8()'s
        one native call), or None (not bound yet, or the op runs)."""
        return self._bound[2]

    def __reduce__(self) -> tuple:
        return LayerBinding, ()

    def __deepcopy__(self, memo: dict) -> LayerBinding:
        return LayerBinding()

    def kernel(self, sources: Sequence[torch.Tensor], settings: tuple, bind: Callable[[], object]):
        """The kernel bound from ``sources`` with ``settings`` (calling ``bind`` where it is
        not current), or None where ``bind`` gave none (no native build: the op runs, and
        reports it)."""
        bound_settings, bound_sources, kernel = self._bound
        current = (
            settings == bound_settings
            and len(sources) == len(bound_sources)
            and all(
                ref() is tensor and fingerprint == _fingerprint(tensor)
                for (ref, fingerprint), tensor in zip(bound_sources, sources)
            )
        )
        if not current:
            kernel = bind()
            self._bound = (settings, tuple((weakref.ref(t), _fingerprint(t)) for t in sources), kernel)
        return kernel


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
