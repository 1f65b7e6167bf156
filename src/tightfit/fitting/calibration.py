"""The time model's figures: what a backend's device does per second, measured once.

``calibrate(backend)`` measures, on the device, in a second or two: matrix-multiply
throughput, device memory bandwidth (a copy), host-to-device copy bandwidth
(accelerators), disk read bandwidth (a fresh file dropped from the page cache), and the
per-weight cost of decoding each compact storage during a forward. The figures are
cached as JSON under ``$TIGHTFIT_CACHE_DIR`` (default ``~/.cache/tightfit``), keyed by
backend, device name and torch version; ``remeasure=True`` measures again. Tests build
a :class:`Calibration` by hand, so that plans are deterministic.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit._validate import check_type
from tightfit.fitting.options import DECODED_STORAGES

__all__ = ["Calibration", "cache_path", "calibrate"]

_FIGURES = ("matmul_flops", "device_bandwidth", "host_to_device_bandwidth", "disk_bandwidth")


@dataclass(frozen=True)
class Calibration:
    """Figures of one device, in units per second, and decode costs in seconds per weight.

    ``host_to_device_bandwidth`` is None where the device is the host (the CPU): nothing
    is copied there. ``decode_seconds`` maps each compact storage (float8, nf4, fp4, 8bit,
    int8) to the extra seconds a forward spends per weight stored so.
    """

    backend: str
    device_name: str
    torch_version: str
    matmul_flops: float
    device_bandwidth: float
    host_to_device_bandwidth: float | None
    disk_bandwidth: float
    decode_seconds: dict[str, float] = field(default_factory=dict)
    measured_seconds: float = 0.0  # how long calibrating took

    def __post_init__(self) -> None:
        for name in ("backend", "device_name", "torch_version"):
            check_type(name, getattr(self, name), str)
        for name in _FIGURES:
            value = getattr(self, name)
            if value is None and name == "host_to_device_bandwidth":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        check_type("decode_seconds", self.decode_seconds, dict)
        missing = set(DECODED_STORAGES) - set(self.decode_seconds)
        if missing:
            raise ValueError(f"decode_seconds lacks {', '.join(sorted(missing))}; it needs one figure per storage: "
                             f"{', '.join(DECODED_STORAGES)}")
        unknown = [key for key in self.decode_seconds if key not in DECODED_STORAGES]
        if unknown:
            raise ValueError(f"decode_seconds has unknown storage(s) {', '.join(map(repr, unknown))}; accepted: "
                             f"{', '.join(DECODED_STORAGES)}")
        for key, value in self.decode_seconds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
                raise ValueError(f"decode_seconds[{key!r}] must be a finite number >= 0, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        check_type("data", data, dict)
        known = {name for name in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"calibration data has unknown keys {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        return cls(**data)


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return f"{line.partition(':')[2].strip()} x{os.cpu_count()}"
        except OSError:
            pass
        return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"
    module = torch.get_device_module(device.type)
    if hasattr(module, "get_device_name"):
        return str(module.get_device_name(device.index or 0))
    return device.type


def cache_path(backend: str, device_name: str) -> Path:
    """Where the figures of ``backend`` on ``device_name`` are cached for this torch version."""
    folder = Path(os.environ.get("TIGHTFIT_CACHE_DIR") or Path.home() / ".cache" / "tightfit")
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{backend}-{device_name}-torch{torch.__version__}").strip("-")
    return folder / f"calibration-{slug}.json"


def _best_seconds(fn: Any, sync: Any, repeat: int = 5) -> float:
    fn()  # warm-up
    sync()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _disk_bandwidth(nbytes: int) -> float:
    """Read a fresh file after asking the OS to drop it from the page cache."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with tempfile.NamedTemporaryFile(prefix="tightfit-calibrate-") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with open(handle.name, "rb", buffering=0) as reader:
            start = time.perf_counter()
            while reader.read(1 << 22):
                pass
            seconds = time.perf_counter() - start
    return len(data) / max(seconds, 1e-9)


def _decode_seconds(device: torch.device, sync: Any) -> dict[str, float]:
    """Seconds per weight that a forward spends decoding each compact storage.

    float8, nf4, fp4 and 8bit layers decode their whole weight once per call: that
    decode is timed alone. int8 multiplies in int8 instead: its forward against the
    full-precision one (never below zero).
    """
    from tightfit import ops
    from tightfit.fitting.options import FLOAT8_DTYPE, QUANT_CONFIGS
    from tightfit.quant import quantize_

    features, rows = 1024, 64
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(features, features)).to(device)
    x = torch.randn(rows, features, device=device)
    stored = base[0].weight.detach().to(FLOAT8_DTYPE)
    scale = torch.ones(features, 1, device=device)
    figures = {"float8": _best_seconds(lambda: ops.cast(stored, torch.float32).mul_(scale), sync)}
    with torch.inference_mode():
        for storage in ("8bit", "nf4", "fp4"):
            model = quantize_(copy.deepcopy(base), QUANT_CONFIGS[storage])
            figures[storage] = _best_seconds(model[0].dequantize, sync)
        model = quantize_(copy.deepcopy(base), QUANT_CONFIGS["int8"])
        figures["int8"] = max(0.0, _best_seconds(lambda: model(x), sync) - _best_seconds(lambda: base(x), sync))
    return {storage: seconds / (features * features) for storage, seconds in figures.items()}


def _measure(backend: Any, device: torch.device) -> Calibration:
    start = time.perf_counter()
    sync = lambda: backend.synchronize(device)  # noqa: E731
    a = torch.randn(1024, 1024, device=device)
    b = torch.randn(1024, 256, device=device)
    matmul = _best_seconds(lambda: a @ b, sync)
    block = torch.ones(16 << 20, dtype=torch.uint8, device=device)
    target = torch.zeros_like(block)  # written once first: the copies time memory, not page faults
    copy_seconds = _best_seconds(lambda: target.copy_(block), sync)
    host_to_device = None
    if device.type != "cpu":
        host = torch.empty(16 << 20, dtype=torch.uint8).pin_memory() if backend.capabilities().async_copy else torch.empty(16 << 20, dtype=torch.uint8)
        host_to_device = host.numel() / _best_seconds(lambda: host.to(device), sync)
    disk = _disk_bandwidth(16 << 20)
    decode = _decode_seconds(device, sync)
    return Calibration(
        backend=backend.name, device_name=_device_name(device), torch_version=torch.__version__,
        matmul_flops=2 * 1024 * 1024 * 256 / matmul,
        device_bandwidth=2 * block.numel() / copy_seconds,  # a copy reads and writes each byte
        host_to_device_bandwidth=host_to_device, disk_bandwidth=disk, decode_seconds=decode,
        measured_seconds=time.perf_counter() - start,
    )


def calibrate(backend: Any = None, *, remeasure: bool = False) -> Calibration:
    """The figures of ``backend``'s device (a name, device or Backend; None: the default),
    from the cache when there, else measured now and cached; ``remeasure`` measures again."""
    from tightfit.backends.resolve import resolve_backend

    check_type("remeasure", remeasure, bool)
    backends, device = resolve_backend(backend)
    chosen = backends[0]
    path = cache_path(chosen.name, _device_name(device))
    if path.is_file() and not remeasure:
        try:
            return Calibration.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, json.JSONDecodeError):
            pass  # a stale or damaged cache file is measured again and rewritten
    figures = _measure(chosen, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures.to_dict(), indent=1))
    except OSError:
        pass  # a read-only home still gets figures, measured each time
    return figures
