"""The time model's figures: what a backend's device does per second, measured once.

``calibrate(backend)`` measures, on the device, once: matrix-multiply throughput,
device memory bandwidth (a copy), host-to-device copy bandwidth (accelerators), disk
read bandwidth (a fresh file dropped from the page cache), and the per-weight cost of
decoding each storage of the storage catalogue during a forward (its format's decode
probe), and each storage's one-token forward (few-token forwards read the stored bytes
in the product, at their own speed). The compute figures are sampled in turns for a fixed time
(:data:`SECONDS_PER_FIGURE` each) and each is the least of its samples (other work on
the machine only adds time), so that a machine doing other work moves the figures
little and the whole takes a time known beforehand, which the progress task names;
the kernels a format compiles at first use are compiled before, under a task of
their own. The figures are cached as JSON under
``$TIGHTFIT_CACHE_DIR`` (default ``~/.cache/tightfit``), keyed by backend, device name
and torch version; ``remeasure=True`` measures again. Tests build a
:class:`Calibration` by hand, so that plans are deterministic.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit._files import cache_dir, read_json
from tightfit._progress import task
from tightfit._validate import check_type
from tightfit.backends.resolve import resolve_backend
from tightfit.quant import storage_formats

__all__ = ["SECONDS_PER_FIGURE", "Calibration", "cache_path", "calibrate"]

#: How long each figure is sampled for (at least :data:`_MIN_SAMPLES` samples).
SECONDS_PER_FIGURE = 0.5
_MIN_SAMPLES = 3
_PROBE_FEATURES, _PROBE_ROWS = 1024, 64  # the layer and the batch the decode probes run on
_TOKEN_FEATURES = 1024  # the layer the one-token probes run on (2 MiB in bf16; larger cost seconds per calibration)
_TOKEN_DTYPES = ("bfloat16", "float32")  # the compute dtypes the one-token probes run in

_FIGURES = ("matmul_flops", "device_bandwidth", "host_to_device_bandwidth", "disk_bandwidth", "cached_read_bandwidth")
_OPTIONAL = ("host_to_device_bandwidth", "cached_read_bandwidth")  # None: not measured on this device
_STATE_BITS = ("8", "32")  # the optimizer state's forms an optimizer probe times
_OPTIMIZER_VALUES = 1 << 20  # the parameter the optimizer probes step


@dataclass(frozen=True)
class Calibration:
    """Figures of one device, in units per second, and decode costs in seconds per weight.

    ``host_to_device_bandwidth`` is None where the device is the host (the CPU): nothing
    is copied there. ``cached_read_bandwidth``: a copy out of a file's pages mapped into
    memory while the page cache holds them, counted as ``device_bandwidth`` counts its copy
    (the CPU only; None where not measured: reads from a mapped file are then priced at
    ``disk_bandwidth``). ``decode_seconds`` maps each storage of the catalogue that decodes
    (bfloat16, float8, 8bit, int8, nf4, fp4 and any registered since) to the extra seconds a
    forward spends per weight stored so. ``token_seconds`` maps a layer's compute dtype
    (``"bfloat16"``, ``"float32"``) to storages (``keep`` included) to the whole seconds per
    weight of a one-token forward of such a layer stored so (the few-token kernels read the
    stored bytes in the product; a kept float32 layer reads twice a bfloat16 one's bytes); a
    storage or dtype without one is priced by the decode and matmul figures.
    ``optimizer_seconds`` maps a state's bits (``"8"``, ``"32"``) to an AdamW step's seconds
    per parameter value with such state (a training plan's optimizer time; without them it
    is priced by the bytes the step moves).
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
    token_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    cached_read_bandwidth: float | None = None
    optimizer_seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("backend", "device_name", "torch_version"):
            check_type(name, getattr(self, name), str)
        for name in _FIGURES:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        check_type("decode_seconds", self.decode_seconds, dict)
        decoded = [storage.name for storage in storage_formats() if storage.decodes]
        missing = set(decoded) - set(self.decode_seconds)
        if missing:
            raise ValueError(
                f"decode_seconds lacks {', '.join(sorted(missing))}; it needs one figure per storage: "
                f"{', '.join(decoded)}"
            )
        unknown = [key for key in self.decode_seconds if key not in decoded]
        if unknown:
            raise ValueError(
                f"decode_seconds has unknown storage(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(decoded)}"
            )
        for key, value in self.decode_seconds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
                raise ValueError(f"decode_seconds[{key!r}] must be a finite number >= 0, got {value!r}")
        check_type("token_seconds", self.token_seconds, dict)
        names = [storage.name for storage in storage_formats()]
        for dtype, figures in self.token_seconds.items():
            if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
                raise ValueError(
                    f"token_seconds has unknown dtype {dtype!r}; accepted: a torch dtype's name, such as "
                    f"{', '.join(_TOKEN_DTYPES)}"
                )
            check_type(f"token_seconds[{dtype!r}]", figures, dict)
            for key, value in figures.items():
                if key not in names:
                    raise ValueError(
                        f"token_seconds[{dtype!r}] has unknown storage {key!r}; accepted: {', '.join(names)}"
                    )
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                    raise ValueError(f"token_seconds[{dtype!r}][{key!r}] must be a finite number > 0, got {value!r}")
        check_type("optimizer_seconds", self.optimizer_seconds, dict)
        for key, value in self.optimizer_seconds.items():
            if key not in _STATE_BITS:
                raise ValueError(f"optimizer_seconds has unknown key {key!r}; accepted: {', '.join(_STATE_BITS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"optimizer_seconds[{key!r}] must be a finite number > 0, got {value!r}")

    @classmethod
    def fixed(cls, **changes: Any) -> Calibration:
        """Round figures measured on nothing (10 GFLOP/s, 10 GB/s memory, 1 GB/s disk, the
        CPU, decoding free), with ``changes`` applied: for plans that must come out the same
        on every machine (tests, fuzzing)."""
        values: dict[str, Any] = dict(
            backend="cpu",
            device_name="fixed",
            torch_version=torch.__version__,
            matmul_flops=1e10,
            device_bandwidth=1e10,
            host_to_device_bandwidth=None,
            disk_bandwidth=1e9,
            decode_seconds={storage.name: 0.0 for storage in storage_formats() if storage.decodes},
        )
        values.update(changes)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        check_type("data", data, dict)
        known = {name for name in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"calibration data has unknown keys {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
            )
        return cls(**data)


def _device_name(device: torch.device, threads: int | None = None) -> str:
    """The device's name, the key of its figures. On the CPU, with torch's thread count
    (``threads``, default the current): a process given fewer threads (each rank of a
    ``torchrun``) computes slower, and is measured for its own."""
    if device.type == "cpu":
        threads = threads or torch.get_num_threads()
        shared = f", {threads} thread{'s' if threads > 1 else ''}"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return f"{line.partition(':')[2].strip()} x{os.cpu_count()}{shared}"
        except OSError:
            pass
        return f"{platform.processor() or platform.machine()} x{os.cpu_count()}{shared}"
    module = torch.get_device_module(device.type)
    if hasattr(module, "get_device_name"):
        return str(module.get_device_name(device.index or 0))
    return device.type


def cache_path(backend: str, device_name: str) -> Path:
    """Where the figures of ``backend`` on ``device_name`` are cached for this torch version."""
    folder = cache_dir()
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{backend}-{device_name}-torch{torch.__version__}").strip("-")
    return folder / f"calibration-{slug}.json"


def _timed(fn: Callable[[], Any], sync: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _least_seconds(
    works: dict[str, Callable[[], Any]], sync: Callable[[], Any], advance: Callable[[int], None]
) -> dict[str, float]:
    """The least seconds of each of ``works`` over ``len(works)`` x :data:`SECONDS_PER_FIGURE`
    (at least :data:`_MIN_SAMPLES` each), taken in turns: one call of each per round.

    Other work on the machine only adds time, so the least sample is the figure; taking
    turns spreads every figure's samples over the whole window, so that a burst of other
    work slows all of them alike instead of one figure (and the storage it prices)."""
    for work in works.values():
        _timed(work, sync)  # caches, allocations and kernels of the first call
    least = dict.fromkeys(works, math.inf)
    window = len(works) * SECONDS_PER_FIGURE
    start, rounds, shown = time.perf_counter(), 0, 0
    while rounds < _MIN_SAMPLES or time.perf_counter() - start < window:
        for name, work in works.items():
            least[name] = min(least[name], _timed(work, sync))
        rounds += 1
        done = min(len(works), int(len(works) * (time.perf_counter() - start) / window))
        advance(done - shown)
        shown = done
    advance(len(works) - shown)
    return {name: max(seconds, 1e-9) for name, seconds in least.items()}


def _disk_bandwidth(nbytes: int) -> float:
    """Read a fresh file after asking the OS to drop it from the page cache, again for
    :data:`SECONDS_PER_FIGURE` (at least :data:`_MIN_SAMPLES` times); the median read (the
    least could be a read the OS served from its cache after all)."""
    data = os.urandom(1 << 20) * (nbytes >> 20)
    with tempfile.NamedTemporaryFile(prefix="tightfit-calibrate-") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())

        def read() -> None:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            with open(handle.name, "rb", buffering=0) as reader:
                while reader.read(1 << 22):
                    pass

        samples: list[float] = []
        start = time.perf_counter()
        while len(samples) < _MIN_SAMPLES or time.perf_counter() - start < SECONDS_PER_FIGURE:
            samples.append(_timed(read, lambda: None))
    return len(data) / max(statistics.median(samples), 1e-9)


def _page_cached(nbytes: int) -> torch.Tensor:
    """``nbytes`` of a file mapped into memory (``torch.from_file``, as a checkpoint's pages
    are), read once so that the page cache holds them; the file is gone, its mapping stays."""
    with tempfile.NamedTemporaryFile(prefix="tightfit-calibrate-") as handle:
        handle.write(b"\x01" * nbytes)
        handle.flush()
        mapped = torch.from_file(handle.name, shared=False, size=nbytes, dtype=torch.uint8)
        mapped.sum()  # every page read in
    return mapped


def _probes(
    device: torch.device, sync: Callable[[], Any], advance: Callable[[int], None]
) -> dict[str, tuple[Any, Any]]:
    """Each decoding storage's probe on a layer of :data:`_PROBE_FEATURES` squared and
    :data:`_PROBE_ROWS` rows, run once: the kernels a format compiles at first use are
    compiled here, before the timed part."""
    torch.manual_seed(0)
    probes = {}
    base = nn.Linear(_PROBE_FEATURES, _PROBE_FEATURES).to(device)
    x = torch.randn(_PROBE_ROWS, _PROBE_FEATURES, device=device)
    for storage in storage_formats():
        if storage.decodes:
            work, baseline = probes[storage.name] = storage.decode_probe(base, x)
            for fn in (work, baseline):
                if fn is not None:
                    fn()
            sync()
            advance(1)
    return probes


def _token_probes(device: torch.device) -> dict[tuple[str, str], Callable[[], Any]]:
    """Per compute dtype of :data:`_TOKEN_DTYPES`, each storage's one-token forward of a
    :data:`_TOKEN_FEATURES` squared layer of it, applied as a plan applies it (the storage's
    own ``apply``), run once: the few-token kernels read the stored bytes in the product, so
    a one-token forward is priced by its own figure, not by a decode plus a matmul. A storage
    that would store such a layer in as many bytes as it has (bfloat16 of a bfloat16 layer)
    changes nothing there, and has no figure."""
    torch.manual_seed(0)
    shape = (_TOKEN_FEATURES, _TOKEN_FEATURES)
    probes = {}
    for name in _TOKEN_DTYPES:
        dtype = getattr(torch, name)
        x = torch.randn(1, _TOKEN_FEATURES, device=device, dtype=dtype)
        for storage in storage_formats():
            if nn.Linear not in storage.leaf_types:
                continue
            if storage.name != "keep" and storage.stored_bytes(shape, dtype) >= math.prod(shape) * dtype.itemsize:
                continue
            model = nn.Sequential(nn.Linear(*shape, bias=False)).to(device, dtype)
            storage.apply(model, frozenset({"0"}))
            probes[name, storage.name] = functools.partial(model, x)
            probes[name, storage.name]()
    return probes


def _measure(backend: Any, device: torch.device) -> Calibration:
    start = time.perf_counter()

    def sync() -> None:
        backend.synchronize(device)

    decoding = sum(storage.decodes for storage in storage_formats())
    with torch.inference_mode():
        with task(
            f"calibrating {backend.name}: preparing the decode probes (kernels compile at first use)", decoding
        ) as advance:
            probes = _probes(device, sync, advance)
            tokens = _token_probes(device)
        a = torch.randn(1024, 1024, device=device)
        b = torch.randn(1024, 256, device=device)
        block = torch.ones(16 << 20, dtype=torch.uint8, device=device)
        target = torch.zeros_like(block)  # written once first: the copies time memory, not page faults
        works = {"matmul": lambda: a @ b, "copy": lambda: target.copy_(block)}
        if device.type == "cpu":
            mapped = _page_cached(block.numel())
            works["cached read"] = lambda: target.copy_(mapped)
        else:
            pinned = backend.capabilities().async_copy
            host = (
                torch.empty(16 << 20, dtype=torch.uint8).pin_memory()
                if pinned
                else torch.empty(16 << 20, dtype=torch.uint8)
            )
            works["host_to_device"] = lambda: host.to(device)
        for name, (work, baseline) in probes.items():
            works[f"decode {name}"] = work
            if baseline is not None:
                works[f"baseline {name}"] = baseline
        for (dtype, name), work in tokens.items():
            works[f"token {dtype} {name}"] = work
        for bits, work in _optimizer_probes(device).items():
            works[f"optimizer {bits}"] = work
        count = 1 + len(works)  # the disk, then the figures sampled in turns
        about = math.ceil(count * SECONDS_PER_FIGURE * 1.25)  # and a quarter again for first calls and slow rounds
        with task(f"calibrating {backend.name} (once, about {about} s)", count) as advance:
            disk = _disk_bandwidth(16 << 20)
            advance(1)
            least = _least_seconds(works, sync, advance)
    decode = {
        name: max(0.0, least[f"decode {name}"] - least.get(f"baseline {name}", 0.0)) / _PROBE_FEATURES**2  # per weight
        for name in probes
    }
    return Calibration(
        backend=backend.name,
        device_name=_device_name(device),
        torch_version=torch.__version__,
        matmul_flops=2 * 1024 * 1024 * 256 / least["matmul"],
        device_bandwidth=2 * block.numel() / least["copy"],  # a copy reads and writes each byte
        host_to_device_bandwidth=block.numel() / least["host_to_device"] if "host_to_device" in least else None,
        disk_bandwidth=disk,
        cached_read_bandwidth=2 * block.numel() / least["cached read"] if "cached read" in least else None,  # as copy
        decode_seconds=decode,
        measured_seconds=time.perf_counter() - start,
        token_seconds={
            dtype: {name: least[f"token {dtype} {name}"] / _TOKEN_FEATURES**2 for kind, name in tokens if kind == dtype}
            for dtype in _TOKEN_DTYPES
        },
        optimizer_seconds={bits: least[f"optimizer {bits}"] / _OPTIMIZER_VALUES for bits in _STATE_BITS},
    )


def _optimizer_probes(device: torch.device) -> dict[str, Callable[[], Any]]:
    """An AdamW step of one float32 parameter, its state 8-bit and 32-bit (tightfit.optim):
    what a training plan's optimizer time is priced by."""
    from tightfit.optim import AdamW

    probes = {}
    with torch.inference_mode(False):
        for bits in _STATE_BITS:
            parameter = nn.Parameter(torch.randn(_OPTIMIZER_VALUES, device=device))
            parameter.grad = torch.randn_like(parameter)
            probes[bits] = AdamW([parameter], lr=1e-4, optim_bits=int(bits)).step
    return probes


def calibrate(backend: Any = None, *, remeasure: bool = False) -> Calibration:
    """The figures of ``backend``'s device (a name, device or Backend; None: the default),
    from the cache when there, else measured now and cached; ``remeasure`` measures again."""

    check_type("remeasure", remeasure, bool)
    backends, device = resolve_backend(backend)
    return figures_of(backends[0], device, remeasure=remeasure)


def figures_of(chosen: Any, device: torch.device, *, remeasure: bool = False) -> Calibration:
    """:func:`calibrate` for a backend and device resolved already (the planner's)."""
    path = cache_path(chosen.name, _device_name(device))
    if path.is_file() and not remeasure:
        try:
            data = read_json(path)
            # stale: cached before one-token forwards (or, on the CPU, page-cache reads) were measured
            if "token_seconds" in data and (device.type != "cpu" or data.get("cached_read_bandwidth")):
                return Calibration.from_dict(data)
        except (ValueError, TypeError):
            pass  # a stale (one-token figures of one dtype) or damaged cache file is measured again and rewritten
    figures = _measure(chosen, device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures.to_dict(), indent=1))
    except OSError:
        pass  # a read-only home still gets figures, measured each time
    return figures
