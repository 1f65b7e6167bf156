"""Backend discovery: entry points in the group ``tightfit.backends``, loaded once, lazily,
under a lock. In-tree backends come through the same group as third-party plugins; a
source tree that was never installed (``PYTHONPATH=src``, a machine without network) has
no entry points, so there the in-tree ones are taken from :data:`BUILTIN_BACKENDS`."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from types import ModuleType

import torch

from tightfit._errors import BackendConflictError
from tightfit.backends.base import Backend

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendEntry",
    "all_backends",
    "available",
    "conflict",
    "get",
    "default",
    "load_plugins",
    "use",
]

ENTRY_POINT_GROUP = "tightfit.backends"

#: The in-tree backends, as ``pyproject.toml`` declares them in the group (a test keeps the two equal).
BUILTIN_BACKENDS = {
    "cpu": "tightfit.backends.cpu:CPUBackend",
    "cuda": "tightfit.backends.cuda:CUDABackend",
    "hpu": "tightfit.backends.hpu:HPUBackend",
    "mps": "tightfit.backends.mps:MPSBackend",
    "xpu": "tightfit.backends.xpu:XPUBackend",
}
_SOURCE_TREE = "tightfit source tree, not installed"
_ENV_BACKEND = "TIGHTFIT_BACKEND"


@dataclass
class BackendEntry:
    """One entry point of the group: the backend it gave, or why it gave none."""

    entry_point: str
    origin: str
    backend: Backend | None = None
    error: str | None = None
    _available: bool | None = field(default=None, init=False, repr=False)

    @property
    def available(self) -> bool:
        """Loaded and usable on this machine (checked once, then cached)."""
        if self.backend is None:
            return False
        if self._available is None:
            with _lock:
                if self._available is None:
                    try:
                        self._available = self.backend.is_available()
                    except Exception as error:  # a driver that fails to initialize
                        self.error = f"is_available() raised {type(error).__name__}: {error}"
                        self._available = False
        return self._available


_lock = threading.RLock()
_loading = threading.local()
_entries: list[BackendEntry] | None = None
_conflict: BackendConflictError | None = None
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("tightfit_backend", default=None)


def _group() -> list[EntryPoint]:
    """The group's entry points in name order, the in-tree ones added where tightfit's own
    distribution declared none (it runs from a source tree)."""
    found = list(entry_points(group=ENTRY_POINT_GROUP))
    if not any(ep.value in BUILTIN_BACKENDS.values() for ep in found):
        found += [EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in BUILTIN_BACKENDS.items()]
    return sorted(found, key=lambda ep: ep.name)


def _origin(entry_point: EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    if dist is not None:
        package = f"{dist.metadata['Name']} {dist.version}"
    else:
        package = _SOURCE_TREE if entry_point.value in BUILTIN_BACKENDS.values() else "unknown distribution"
    return f"{package} ({entry_point.value})"


def _check_declaration(backend: Backend) -> None:
    for attribute in ("name", "device_type"):
        value = getattr(backend, attribute, None)
        if not isinstance(value, str) or not value:
            raise TypeError(f"{type(backend).__qualname__}.{attribute} must be a non-empty str, got {value!r}")
    if isinstance(backend.priority, bool) or not isinstance(backend.priority, int):
        raise TypeError(f"{type(backend).__qualname__}.priority must be an int, got {backend.priority!r}")


def _load_entry(entry_point: EntryPoint) -> BackendEntry:
    entry = BackendEntry(entry_point=entry_point.name, origin=_origin(entry_point))
    try:
        loaded = entry_point.load()
        backend = loaded() if isinstance(loaded, type) else loaded
        if not isinstance(backend, Backend):
            raise TypeError(f"entry point gave {type(backend).__name__}, not a tightfit Backend")
        _check_declaration(backend)
        entry.backend = backend
    except Exception as error:  # a broken plugin is reported, never fatal
        frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        entry.error = f"{type(error).__name__}: {error}{where}"
    return entry


def _find_conflict(entries: list[BackendEntry]) -> BackendConflictError | None:
    claims: dict[str, BackendEntry] = {}
    for entry in entries:
        if entry.backend is None:
            continue
        first = claims.setdefault(entry.backend.device_type, entry)
        if first is not entry:
            return BackendConflictError(
                f"two backend plugins claim device type {entry.backend.device_type!r}: "
                f"{first.origin} and {entry.origin}; uninstall one of them"
            )
    return None


def _load() -> tuple[list[BackendEntry], BackendConflictError | None]:
    """Load every entry point once; later calls return the cached (entries, conflict)."""
    global _entries, _conflict
    entries, conflict = _entries, _conflict
    if entries is not None:
        return entries, conflict
    with _lock:
        if _entries is None:
            if getattr(_loading, "active", False):
                raise RuntimeError(
                    "a backend plugin used tightfit.backends or an op while it was being loaded; "
                    "plugins must not touch tightfit at import or construction"
                )
            _loading.active = True
            try:
                loaded = [_load_entry(ep) for ep in _group()]
            finally:
                _loading.active = False
            _conflict = _find_conflict(loaded)
            _entries = loaded
        return _entries, _conflict


def _checked_entries() -> list[BackendEntry]:
    entries, conflict = _load()
    if conflict is not None:
        raise conflict
    return entries


def _clear_cache() -> None:
    """Forget loaded backends so the next call looks again (tests, plugin installs)."""
    global _entries, _conflict
    with _lock:
        _entries = None
        _conflict = None


def conflict() -> BackendConflictError | None:
    """The duplicate device claim found while loading plugins, if any (for reports)."""
    return _load()[1]


def all_backends() -> list[BackendEntry]:
    """Every entry point, loaded or failed, in name order (for reports; never raises)."""
    return list(_load()[0])


def load_plugins() -> None:
    """Import every backend plugin now (once), so the kernels they register are in place."""
    _load()


def available() -> list[Backend]:
    """Backends usable on this machine, highest priority first."""
    usable = [entry.backend for entry in _checked_entries() if entry.available]
    return sorted(usable, key=lambda backend: (-backend.priority, backend.name))


def _lookup(name: str) -> Backend:
    entries = [entry for entry in _checked_entries() if entry.backend is not None]
    for entry in entries:
        if entry.backend.name == name or entry.backend.device_type == name:
            if not entry.available:
                reason = f": {entry.error}" if entry.error else ""
                raise RuntimeError(f"backend {name!r} is installed but not available on this machine{reason}")
            return entry.backend
    known = sorted({e.backend.name for e in entries} | {e.backend.device_type for e in entries})
    raise ValueError(f"backend {name!r} is not known; known backends: {', '.join(known) or 'none'}")


def get(device_or_name: str | torch.device | torch.Tensor) -> Backend:
    """The backend for a device (``"cuda:1"``, ``torch.device``), a tensor, or a backend name."""
    if isinstance(device_or_name, torch.Tensor):
        return _lookup(device_or_name.device.type)
    if isinstance(device_or_name, torch.device):
        return _lookup(device_or_name.type)
    if not isinstance(device_or_name, str):
        raise TypeError(
            f"device_or_name must be str, torch.device or Tensor, got {type(device_or_name).__name__}: {device_or_name!r}"
        )
    name = device_or_name.strip()
    if ":" in name:
        try:
            name = torch.device(name).type
        except RuntimeError as error:
            raise ValueError(f"device_or_name={device_or_name!r} is not a valid device: {error}") from None
    return _lookup(name)


def shares_host_memory(device: torch.device) -> bool:
    """Whether ``device``'s memory is the host's: the CPU, or a backend that declares
    ``unified_memory`` (Apple silicon). Moving tensors to host memory frees nothing there,
    so paged optimizer state stays where it is and activations are not offloaded. Private to
    tightfit (paged optimizer state, the training plan)."""
    return device.type == "cpu" or bool(get(device).capabilities().unified_memory)


def copy_streams(device: torch.device) -> ModuleType | None:
    """The device module whose streams copy to and from host memory asynchronously
    (``torch.cuda`` and alike), for a side-stream prefetch; None on the CPU, where the
    device's backend declares no ``async_copy``, or where the module has no streams.
    Private to tightfit (offloading and paged optimizer state)."""
    if device.type == "cpu" or not get(device).capabilities().async_copy:
        return None
    module = torch.get_device_module(device.type)
    return module if hasattr(module, "Stream") else None


def default() -> Backend:
    """The backend to use: ``use(...)`` in scope, else $TIGHTFIT_BACKEND, else highest priority."""
    chosen = _override.get()
    if chosen is not None:
        return get(chosen)
    from_env = os.environ.get(_ENV_BACKEND, "").strip()
    if from_env:
        try:
            return get(from_env)
        except (ValueError, RuntimeError) as error:
            raise type(error)(f"{_ENV_BACKEND}={from_env!r}: {error}") from None
    usable = available()
    if not usable:
        raise RuntimeError("no tightfit backend is available; run `tightfit backends` to see why")
    return usable[0]


@contextlib.contextmanager
def use(name: str) -> Iterator[Backend]:
    """Make ``name`` the default backend within the block (per thread and task)."""
    backend = get(name)  # validate now, not at first use
    token = _override.set(name)
    try:
        yield backend
    finally:
        _override.reset(token)
