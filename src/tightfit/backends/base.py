"""The small surface a backend implements, and the descriptions it returns.

A backend subclasses :class:`Backend` and implements the private ``_``-methods; the
public methods wrap them and add context to errors, so a vendor writes only what is
specific to its device.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx

from tightfit.hints.schema import keys_honored_by

__all__ = ["Backend", "Capabilities", "MemoryInfo", "FLOAT8_DTYPES", "INTEGER_DTYPES", "RUNTIME_HINTS"]

T = TypeVar("T")

#: Every float8 kind this build of torch knows.
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


#: Integer dtypes every backend stores (codes, indices, int8 products).
INTEGER_DTYPES: frozenset[torch.dtype] = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


#: Hints that tightfit's graph runtime carries out itself on any device (see docs/compile.md):
#: a backend that runs its graphs through tightfit's executor declares these in ``hints``.
#: Read off the hint table (the keys some graph pass honors); the table is plain data at
#: the bottom of tightfit.hints, which imports nothing of the layers above backends.
RUNTIME_HINTS: frozenset[str] = keys_honored_by()


@dataclass(frozen=True)
class Capabilities:
    """What a backend can store and compute, and which features it offers.

    ``hints`` are the hint keys the backend honors (others are ignored with a debug
    log line, or raise in strict mode); ``unsupported_ops`` names ops the backend cannot
    run, as ``"namespace::name"`` (``"aten::_softmax"``) or with an overload
    (``"aten::add.Tensor"``): the compile backend places them on another backend.
    """

    storage_dtypes: frozenset[torch.dtype]
    compute_dtypes: frozenset[torch.dtype]
    async_copy: bool = False
    unified_memory: bool = False
    paged_memory: bool = False
    hints: frozenset[str] = field(default_factory=frozenset)
    unsupported_ops: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class MemoryInfo:
    """Memory figures in bytes; ``None`` where the device does not report one.

    ``source`` says what ``allocated`` and ``peak`` count: an accelerator's caching
    allocator, or the process's resident set on the CPU.
    """

    total: int | None
    free: int | None
    allocated: int | None
    peak: int | None
    source: str


class Backend(abc.ABC):
    """One kind of device as tightfit sees it.

    Subclasses set ``name``, ``device_type`` and ``priority`` and implement the
    ``_``-methods. Construction must be cheap and touch no device: it happens when
    tightfit first looks for backends.
    """

    name: str
    device_type: str
    priority: int = 0

    # -- what a backend implements -------------------------------------------------
    @abc.abstractmethod
    def _is_available(self) -> bool: ...

    @abc.abstractmethod
    def _capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def _memory(self, device: torch.device) -> MemoryInfo: ...

    @abc.abstractmethod
    def _reset_peak_memory(self, device: torch.device) -> None: ...

    @abc.abstractmethod
    def _synchronize(self, device: torch.device) -> None: ...

    def _compile_split(
        self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]
    ) -> Callable[..., Any] | None:
        """Optional: compile one split of a graph for this device, or None for tightfit's default.

        ``graph_module`` is an aten-level FX graph whose nodes carry fake-tensor
        metadata and the hints of their regions (read them with ``tightfit.hints_of``);
        ``example_inputs`` are fake tensors. The callable takes the inputs positionally
        and returns a tuple of outputs.
        """
        return None

    # -- public surface --------------------------------------------------------------
    def is_available(self) -> bool:
        """Whether this machine can run the backend now (may initialize the driver)."""
        return bool(self._is_available())

    def capabilities(self) -> Capabilities:
        """Dtypes and features; may query the device, so call after ``is_available()``."""
        try:
            return self._capabilities()
        except Exception as error:  # add context, keep the cause
            raise RuntimeError(f"reading capabilities of backend {self.name} failed: {error}") from error

    def device(self, index: int | None = None) -> torch.device:
        """The torch device for this backend (``index`` picks one of several)."""
        if index is None:
            return torch.device(self.device_type)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int or None, got {type(index).__name__}: {index!r}")
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        return torch.device(self.device_type, index)

    def compile_split(self, graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any] | None:
        """This backend's own compiled code for one split of a graph, or None (tightfit's default)."""
        try:
            compiled = self._compile_split(graph_module, example_inputs)
        except Exception as error:  # add context, keep the cause
            raise RuntimeError(
                f"backend {self.name} failed to compile a split of {len(graph_module.graph.nodes)} nodes: {error}"
            ) from error
        if compiled is not None and not callable(compiled):
            raise TypeError(
                f"backend {self.name}: _compile_split must return a callable or None, got {type(compiled).__name__}"
            )
        return compiled

    def memory(self, device: torch.device | str | None = None) -> MemoryInfo:
        """Total, free, allocated and peak bytes of one device of this backend."""
        return self._on_device("reading memory of", device, self._memory)

    def reset_peak_memory(self, device: torch.device | str | None = None) -> None:
        """Start a new peak measurement on one device."""
        self._on_device("resetting peak memory of", device, self._reset_peak_memory)

    def synchronize(self, device: torch.device | str | None = None) -> None:
        """Wait for all queued work on one device."""
        self._on_device("synchronizing", device, self._synchronize)

    def _on_device(self, action: str, device: torch.device | str | None, method: Callable[[torch.device], T]) -> T:
        """Run a backend method on a validated device; errors gain the device and backend."""
        target = self.resolve_device(device)
        try:
            return method(target)
        except Exception as error:  # add context, keep the cause
            raise RuntimeError(f"{action} {target} (backend {self.name}) failed: {error}") from error

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} device_type={self.device_type!r} priority={self.priority}>"

    def resolve_device(self, device: torch.device | str | None) -> torch.device:
        """The torch device this backend means by ``device`` (None: its first device)."""
        if device is None:
            return self.device(0 if self.device_type != "cpu" else None)
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be torch.device, str or None, got {type(device).__name__}: {device!r}")
        try:
            resolved = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device={device!r} is not a valid torch device: {error}") from None
        if resolved.type != self.device_type:
            raise ValueError(f"device={device!r} is not a {self.device_type} device (backend {self.name})")
        return resolved
