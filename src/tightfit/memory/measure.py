"""Measuring memory honestly (see docs/architecture.md): accelerators report their allocator's
peak; on the CPU torch keeps no statistics, so tightfit counts the bytes of live tensor
storages itself, reads the allocator's own allocation events (which also see the scratch
buffers a kernel allocates and frees inside one op) and the process's peak resident set
size. Asked for, a measurement also keeps a timeline: the bytes after every op of one call.

Threads: torch's profiler and the process's peak RSS are process-wide, so the CPU
measurements that use them (:func:`allocated_peak`, the memory part of :func:`measure`)
run one thread at a time; a second thread waits for the first to finish."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tightfit._validate import check_device
from tightfit.backends import get
from tightfit.backends.cpu import read_process_memory, reset_process_peak

__all__ = [
    "AllocatedBytes",
    "Lifetime",
    "LiveTensorBytes",
    "Measurement",
    "MemoryTimeline",
    "allocated_peak",
    "mark",
    "measure",
    "tensor_bytes",
]

_THREAD = threading.local()  # .recording: this thread's recording modes, innermost last (dispatch modes are per thread)
# Held while torch's profiler runs, and while measure resets and reads the process's peak RSS:
# both are process-wide, and two profiler sessions at once crash the process (SIGSEGV).
_PROCESS_WIDE = threading.RLock()


def _recording() -> list[_Recorder]:
    if not hasattr(_THREAD, "recording"):
        _THREAD.recording = []
    return _THREAD.recording


def mark(label: str) -> None:
    """Label the next sample of every timeline this thread is recording (``"prefill"``, ``"decode"``); else nothing."""
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}: {label!r}")
    for recorder in _recording():
        recorder.marks.append((len(recorder.samples), label))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and ties counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = storage.nbytes()  # identity of the storage, also for meta tensors
    return sum(seen.values())


class _Recorder(TorchDispatchMode):
    """A dispatch mode that, with ``record``, keeps one sample per aten op and the marks."""

    def __init__(self, record: bool) -> None:
        super().__init__()
        if not isinstance(record, bool):
            raise TypeError(f"record must be a bool, got {type(record).__name__}: {record!r}")
        self.record = record
        self.samples: list[int] = []
        self.marks: list[tuple[int, str]] = []

    def __enter__(self) -> Any:
        entered = super().__enter__()
        if self.record:
            _recording().append(self)
        return entered

    def __exit__(self, *exc: Any) -> Any:
        if self.record:
            _recording().remove(self)
        return super().__exit__(*exc)


@dataclass
class Lifetime:
    """One storage an op created: its name (``op_step``), device, bytes, and the steps it was
    born at and last alive at (``end`` None while it is alive)."""

    name: str
    device: str
    nbytes: int
    start: int
    end: int | None = None


class LiveTensorBytes(_Recorder):
    """The lifetime tracker: when each storage an op creates is born, when it dies, and the bytes alive.

    One tracker under measuring and predicting, as ggml's gallocr runs one allocator for
    its dry run and its real one: on real tensors it measures a run, on fake tensors it
    is the eager plan's simulation (:mod:`tightfit.memory.simulate`), so the two cannot
    count differently. A step is one aten op (``prim`` metadata queries are none); after
    each, the storages no Python object refers to any longer are dead (their ``end`` is
    the step before), and those the op created are born.

    ``current`` is what is still alive now on ``device_type`` (None: every device) and
    ``peak`` the most seen alive at once; ``lifetimes`` holds a :class:`Lifetime` per
    storage created, ``steps`` the name of each step and ``step_phases`` the ``phase``
    it ran in (a label the caller sets: "forward", "backward"). Storages that existed
    before entry (weights) are not counted, even when a view or an in-place op returns
    them: add them yourself, or pass them as ``existing``: those count from the start
    until they are freed (weights that a hook replaces during the run). With ``record``,
    ``samples`` keeps ``current`` after every op (a timeline).
    """

    def __init__(
        self, device_type: str | None = "cpu", existing: Iterable[torch.Tensor] = (), *, record: bool = False
    ) -> None:
        super().__init__(record)
        if device_type is not None and (not isinstance(device_type, str) or not device_type):
            raise ValueError(f"device_type must be a non-empty str or None (every device), got {device_type!r}")
        self.device_type = device_type
        self.steps: list[str] = []
        self.step_phases: list[str] = []
        self.phase = ""
        self.lifetimes: list[Lifetime] = []
        self._live: dict[StorageWeakRef, int] = {}  # -> bytes
        self._index: dict[StorageWeakRef, int] = {}  # -> position in lifetimes (not for existing storages)
        self._foreign: set[StorageWeakRef] = set()  # seen first as an input: existed before entry
        for tensor in existing:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"existing must hold tensors, got {type(tensor).__name__}")
            if self._counts(tensor):
                storage = tensor.untyped_storage()
                self._live[StorageWeakRef(storage)] = storage.nbytes()
        self.current = sum(self._live.values())
        self.peak = self.current

    def _counts(self, tensor: torch.Tensor) -> bool:
        return self.device_type is None or tensor.device.type == self.device_type

    def _tensors(self, tree: Any) -> list[torch.Tensor]:
        return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor) and self._counts(leaf)]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "prim":  # metadata queries (prim::device, ...): no storage, no step
            return func(*args, **(kwargs or {}))
        for tensor in self._tensors((args, kwargs)):
            ref = StorageWeakRef(tensor.untyped_storage())
            if ref not in self._live:
                self._foreign.add(ref)
        result = func(*args, **(kwargs or {}))
        step = len(self.steps)
        for ref in [ref for ref in self._live if ref.expired()]:
            self.current -= self._live.pop(ref)
            if ref in self._index:
                self.lifetimes[self._index.pop(ref)].end = step - 1
        self._foreign = {ref for ref in self._foreign if not ref.expired()}  # a freed address may be reused
        name = f"{func._schema.name.split('::')[-1]}_{step}"
        self.steps.append(name)
        self.step_phases.append(self.phase)
        for index, tensor in enumerate(self._tensors(result)):
            storage = tensor.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref in self._live or ref in self._foreign:
                continue
            nbytes = int(storage.nbytes())
            self._live[ref] = nbytes
            self._index[ref] = len(self.lifetimes)
            self.lifetimes.append(
                Lifetime(name if index == 0 else f"{name}[{index}]", str(tensor.device), nbytes, step)
            )
            self.current += nbytes
        self.peak = max(self.peak, self.current)
        if self.record:
            self.samples.append(self.current)
        return result

    def alive(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """Positions in ``lifetimes`` of the storages behind ``tensors`` that are alive and were created here."""
        found = (self._index.get(StorageWeakRef(tensor.untyped_storage())) for tensor in tensors)
        return sorted({index for index in found if index is not None})


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """Silence file descriptor 2 for a moment: the profiler's native library prints a line
    at every start and stop that no setting turns off. Only start and stop run muted (other
    threads' writes to fd 2 in that moment are lost too); callers hold ``_PROCESS_WIDE``, so
    no other muting can save our /dev/null as "the" stderr. Where fd 2 is closed or /dev/null
    cannot be opened, nothing is muted."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):  # a closed or broken sys.stderr has nothing to flush
            sys.stderr.flush()
    with contextlib.ExitStack() as restore:  # undone last in, first out, on any exit
        with contextlib.suppress(OSError):  # fd 2 closed, no /dev/null, no free fd: print rather than fail
            saved = os.dup(2)
            restore.callback(os.close, saved)
            devnull = os.open(os.devnull, os.O_WRONLY)
            restore.callback(os.close, devnull)
            restore.callback(os.dup2, saved, 2)  # registered before the switch: an interrupt cannot skip it
            os.dup2(devnull, 2)
        yield


def allocated_peak(fn: Callable[[], Any]) -> int:
    """The most bytes the CPU allocator held at once during ``fn()``, above what it held before.

    Read from the profiler's allocation events: unlike :class:`LiveTensorBytes`, which
    counts once per op, it sees the scratch buffers a kernel allocates and frees inside one
    op (LLM.int8's float32 temporaries, for instance). Too slow for timed calls.

    Only this thread's allocations count (torch's profiler records the thread that started
    it). Calls from several threads take turns: a second waits until the first returns. A
    torch profiler already running in this thread (``torch.profiler.profile``, or
    ``allocated_peak`` inside ``fn``) is refused with a RuntimeError; one that another thread
    runs outside tightfit cannot be seen, and must not overlap.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if torch._C._autograd._profiler_enabled():
        raise RuntimeError(
            "allocated_peak needs torch's profiler to itself, but a profiler is already running in this thread "
            "(torch.profiler.profile, or allocated_peak inside fn); call it outside that profiler"
        )
    with _PROCESS_WIDE:
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _native_stderr_muted():
            profiler.start()
        try:
            fn()
        finally:
            with _native_stderr_muted():
                profiler.stop()
        events = sorted(
            (e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
        )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def _allocated_reader(device: torch.device) -> Callable[[], int]:
    """Reads ``torch.accelerator``'s allocated bytes; the backend's figure before torch 2.9 had them."""
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated"):
        return functools.partial(torch.accelerator.memory_allocated, device)
    backend = get(device)
    return lambda: backend.memory(device).allocated


class AllocatedBytes(_Recorder):
    """Samples an accelerator's allocated bytes (``torch.accelerator`` statistics) after every aten op.

    The allocator keeps its own count, so this only reads it; ``samples`` are absolute
    (weights included). ``read`` (no argument, returns bytes) replaces the reading, for tests
    and for backends whose device module counts differently.
    """

    def __init__(self, device: torch.device | str, read: Callable[[], int] | None = None) -> None:
        super().__init__(record=True)
        device = check_device("device", device)
        if read is None:
            read = _allocated_reader(device)
        if not callable(read):
            raise TypeError(f"read must be callable, got {type(read).__name__}")
        self._read = read
        self.samples.append(int(read()))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        self.samples.append(int(self._read()))
        return result


@dataclass(frozen=True)
class MemoryTimeline:
    """Bytes on one device after each op of one measured call, and labels for its phases.

    ``samples``: absolute bytes (weights included), one per aten op; ``marks``: (index of
    the first sample of a phase, label); ``source``: what the samples count.
    """

    device: str
    samples: tuple[int, ...]
    marks: tuple[tuple[int, str], ...]
    source: str

    @property
    def peak_bytes(self) -> int:
        return max(self.samples, default=0)

    def plot(
        self,
        path: str | Path,
        *,
        title: str = "",
        budget_bytes: int | None = None,
        predicted_peak_bytes: int | None = None,
    ) -> Path:
        """Write a PNG of the samples, with the budget and the predicted peak as lines where given."""
        from tightfit.memory.plot import plot_timeline

        return plot_timeline(
            self, path, title=title, budget_bytes=budget_bytes, predicted_peak_bytes=predicted_peak_bytes
        )


@dataclass(frozen=True)
class Measurement:
    """Seconds per call and peak memory of a measured callable on one device.

    ``peak_bytes`` is the accelerator allocator's peak, or on the CPU the peak bytes of
    live tensors created during the calls plus ``baseline_bytes`` (what existed before,
    such as weights). ``allocated_peak_bytes`` also counts what kernels allocate and free
    inside one op: the same as ``peak_bytes`` on an accelerator, on the CPU
    ``baseline_bytes`` plus :func:`allocated_peak` of one more call; what a budget is held
    to. ``peak_rss_bytes`` is the process's peak RSS (CPU only).
    ``timeline``: the bytes after each op of one more call, when asked for.
    ``results``: what ``fn`` returned in each timed call, in order, when asked for
    (``keep_results``); the warmup and the memory-tracking calls are not among them.
    """

    device: str
    seconds: list[float]
    baseline_bytes: int
    peak_bytes: int | None
    peak_rss_bytes: int | None
    source: str
    timeline: MemoryTimeline | None = None
    allocated_peak_bytes: int | None = None
    results: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


def measure(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    repeat: int = 5,
    warmup: int = 1,
    baseline_bytes: int = 0,
    timeline: bool = False,
    keep_results: bool = False,
) -> Measurement:
    """Time ``fn`` ``repeat`` times after ``warmup`` calls, then record its peak memory.

    Timing runs untracked; on the CPU one more call runs under :class:`LiveTensorBytes`,
    whose per-op bookkeeping would otherwise inflate the latency. With ``timeline`` that
    call also keeps a sample per op (on an accelerator, one more call under
    :class:`AllocatedBytes`, after the peak is read). On the CPU a last call runs under
    :func:`allocated_peak`. With ``keep_results``, ``Measurement.results`` holds what
    the timed calls returned (kept alive until the measurement is dropped).
    """
    for name, flag in (("timeline", timeline), ("keep_results", keep_results)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}: {flag!r}")
    for name, value, low in (("repeat", repeat, 1), ("warmup", warmup, 0), ("baseline_bytes", baseline_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    backend = get(device)
    device = backend.resolve_device(device)
    for _ in range(warmup):
        fn()
    backend.synchronize(device)
    if device.type != "cpu":
        backend.reset_peak_memory(device)
    seconds, results = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        backend.synchronize(device)
        seconds.append(time.perf_counter() - start)
        if keep_results:
            results.append(result)
        del result
    if device.type != "cpu":
        info = backend.memory(device)
        recorded = None
        if timeline:
            with AllocatedBytes(device) as sampler:
                fn()
            backend.synchronize(device)
            recorded = MemoryTimeline(str(device), tuple(sampler.samples), tuple(sampler.marks), info.source)
        return Measurement(
            str(device), seconds, baseline_bytes, info.peak, None, info.source, recorded, info.peak, tuple(results)
        )
    with _PROCESS_WIDE:  # another thread's measure would reset the peak RSS in the middle of this one
        rss_reset = reset_process_peak()
        with LiveTensorBytes("cpu", record=timeline) as tracker:
            fn()
        peak_rss = read_process_memory()[1] if rss_reset else None  # without a reset it is the lifetime peak
        allocated = baseline_bytes + allocated_peak(fn)
    source = "live tensors: weights + created by the run"
    recorded = None
    if timeline:
        samples = tuple(baseline_bytes + sample for sample in [0, *tracker.samples])
        recorded = MemoryTimeline(
            str(device), samples, tuple((index + 1, label) for index, label in tracker.marks), source
        )
    return Measurement(
        str(device),
        seconds,
        baseline_bytes,
        baseline_bytes + tracker.peak,
        peak_rss,
        source,
        recorded,
        allocated,
        tuple(results),
    )
