"""One way to declare an op (D1, D4): a ``torch.library`` custom op whose default kernel
is the pure-torch reference, a fake kernel for tracing, per-device kernels, and the
conformance cases that hold the kernels to the reference.

The default kernel only runs when the tensor's device has no kernel of its own, so it
is where fallbacks are reported: once per (op, device) as a warning, or as an error in
strict mode. Where the reference cannot run on the device at all, the op runs on the
CPU with copies in and out.

An op's ``check`` is what keeps its kernels memory-safe (D9): lengths, shapes, dtypes,
strides, blocksizes, devices. It reads metadata only, never values (no device sync), and
runs on every path before any kernel: the direct call, every registered kernel, the
default kernel and the fake kernel (so a compiled graph is refused while tracing).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tightfit._strict import report_fallback

__all__ = ["Case", "KernelInfo", "OpDef", "define_op", "register_kernel", "registered_ops", "get_op"]

NAMESPACE = "tightfit"


@dataclass(frozen=True)
class Case:
    """One conformance input: CPU tensors and plain values, in the op's argument order."""

    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class KernelInfo:
    """A kernel registered for one device type, and who registered it."""

    device_type: str
    fn: Callable[..., Any]
    label: str
    source: str


def _no_check(*args: Any) -> None:
    """The check of an op whose kernels are safe for anything its schema admits."""


@dataclass
class OpDef:
    """Everything tightfit knows about one op."""

    name: str
    reference: Callable[..., Any]
    custom_op: Any
    mutated: tuple[int, ...]
    cases: Callable[[], Iterable[Case]]
    metric: str | float
    unsupported: Callable[[torch.device, tuple[Any, ...]], str | None] | None = None
    check: Callable[..., None] = _no_check
    kernels: dict[str, KernelInfo] = field(default_factory=dict)

    def __call__(self, *args: Any) -> Any:
        """Dispatch on the arguments' device; the op's check runs first on every path."""
        if not torch.compiler.is_compiling():  # when tracing, the fake kernel checks and loads them
            self.check(*args)  # here too, so a wrong type is named before the schema sees it
            _ensure_plugins_loaded()
            kernel = self._direct_kernel(args)
            if kernel is not None:
                return kernel(*args)
        return self.custom_op(*args)

    def _direct_kernel(self, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        """The device's own kernel when the dispatcher would add nothing: no dispatch or
        function modes active, only plain tensors, nothing for autograd to record. Calling
        it directly saves the dispatcher's Python layers (tens of microseconds a call,
        which is what small layers and GPU calls are made of); otherwise None."""
        if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
            return None
        recording = torch.is_grad_enabled()
        device = None
        for arg in args:
            if isinstance(arg, torch.Tensor):
                if type(arg) not in _PLAIN_TENSORS or (recording and arg.requires_grad):
                    return None
                device = device or arg.device
        kernel = self.kernels.get(device.type) if device is not None else None
        return kernel.fn if kernel is not None else None


#: Tensor types the dispatcher treats alike (a Parameter turns its torch-function override off).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

_ops: dict[str, OpDef] = {}
_ops_lock = threading.Lock()


def _ensure_plugins_loaded() -> None:
    """Import backend plugins before dispatch, so their kernels are in place (cached after once)."""
    from tightfit.backends.registry import load_plugins

    load_plugins()


def _first_device(args: tuple[Any, ...]) -> torch.device:
    leaves, _ = tree_flatten(args)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def _run_on_cpu(opdef: OpDef, args: tuple[Any, ...], device: torch.device) -> Any:
    """Copy tensors to the CPU, run the reference there, copy results and mutations back."""
    cpu_args = tree_map(lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf, args)
    result = opdef.reference(*cpu_args)
    for index in opdef.mutated:
        args[index].copy_(cpu_args[index])
    return tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, result)


def _checked(opdef: OpDef, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind the op's check: what the dispatcher calls for a device's kernel."""

    @functools.wraps(fn)
    def kernel(*args: Any) -> Any:
        opdef.check(*args)
        return fn(*args)

    return kernel


def _default_kernel(opdef: OpDef, args: tuple[Any, ...]) -> Any:
    opdef.check(*args)
    device = _first_device(args)
    _ensure_plugins_loaded()  # the raw torch.ops entry point may get here before any plugin loaded
    kernel = opdef.kernels.get(device.type)
    if kernel is not None:
        return kernel.fn(*args)
    reason = opdef.unsupported(device, args) if opdef.unsupported is not None else None
    if reason is None:
        report_fallback(
            opdef.name,
            device.type,
            "reference",
            f"no {device.type} kernel is registered; running the pure-torch reference kernel",
        )
        try:
            return opdef.reference(*args)
        except NotImplementedError as error:
            if device.type == "cpu":
                raise
            reason = str(error).splitlines()[0]
    report_fallback(
        opdef.name,
        device.type,
        "cpu",
        f"the op cannot run on {device.type} ({reason}); running it on the CPU with copies",
    )
    return _run_on_cpu(opdef, args, device)


def define_op(
    name: str,
    reference: Callable[..., Any],
    *,
    fake: Callable[..., Any],
    cases: Callable[[], Iterable[Case]],
    metric: str | float = "bitwise",
    mutates_args: tuple[str, ...] = (),
    unsupported: Callable[[torch.device, tuple[Any, ...]], str | None] | None = None,
    check: Callable[..., None] | None = None,
) -> OpDef:
    """Declare ``tightfit::<name>`` with ``reference`` as its specification.

    ``metric`` is ``"bitwise"`` or a normalized-MSE threshold for conformance;
    ``unsupported(device, args)`` returns why the op cannot run on a device, or None;
    ``check(*args)`` raises ValueError / TypeError for arguments a kernel must not see.
    """
    if check is not None and not callable(check):
        raise TypeError(f"check must be callable or None, got {type(check).__name__}: {check!r}")
    if name in _ops:
        raise ValueError(f"op {name!r} is already defined")
    parameters = list(inspect.signature(reference).parameters)
    for arg in mutates_args:
        if arg not in parameters:
            raise ValueError(
                f"mutates_args names {arg!r}, which is not a parameter of the reference; parameters: {', '.join(parameters)}"
            )
    opdef = OpDef(
        name=name,
        reference=reference,
        custom_op=None,
        mutated=tuple(parameters.index(arg) for arg in mutates_args),
        cases=cases,
        metric=metric,
        unsupported=unsupported,
        check=check or _no_check,
    )

    @functools.wraps(reference)
    def default(*args: Any) -> Any:
        return _default_kernel(opdef, args)

    opdef.custom_op = torch.library.custom_op(f"{NAMESPACE}::{name}", default, mutates_args=mutates_args)

    @functools.wraps(fake)
    def traced(*args: Any) -> Any:
        _ensure_plugins_loaded()  # runs while compiling, before the compiled graph ever dispatches
        opdef.check(*args)
        return fake(*args)

    opdef.custom_op.register_fake(traced)
    with _ops_lock:
        if name in _ops:
            raise ValueError(f"op {name!r} is already defined")
        _ops[name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    """The registered op called ``name``."""
    if not isinstance(name, str):
        raise TypeError(f"op must be str, got {type(name).__name__}: {name!r}")
    opdef = _ops.get(name)
    if opdef is None:
        raise ValueError(f"op {name!r} is not registered; registered ops: {', '.join(sorted(_ops))}")
    return opdef


def registered_ops() -> dict[str, OpDef]:
    """All ops by name."""
    return dict(_ops)


def register_kernel(op: str, device_type: str, fn: Callable[..., Any], *, label: str | None = None) -> None:
    """Give ``op`` a kernel for ``device_type``; a later registration replaces an earlier one.

    This is how backend plugins add or override kernels. ``fn`` takes the op's
    arguments in order and must agree with the reference kernel.
    """
    opdef = get_op(op)
    if not isinstance(device_type, str) or not device_type or ":" in device_type:
        raise ValueError(f"device_type must be a device type such as 'cuda' (no index), got {device_type!r}")
    try:
        torch.device(device_type)
    except RuntimeError:
        raise ValueError(
            f"device_type={device_type!r} is not a device type torch knows; a new device must first take "
            "torch's PrivateUse1 slot (torch.utils.rename_privateuse1_backend), as its torch extension does"
        ) from None
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}: {fn!r}")
    opdef.custom_op.register_kernel(device_type)(_checked(opdef, fn))
    opdef.kernels[device_type] = KernelInfo(
        device_type=device_type,
        fn=fn,
        label=label or getattr(fn, "__qualname__", repr(fn)),
        source=getattr(fn, "__module__", None) or "unknown",
    )
