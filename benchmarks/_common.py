"""Helpers the CPU decode benchmarks share (``decode_cpu.py``, ``matmul_cpu.py``): the
machine's read-bandwidth roof, measured in the same run as the figures it bounds, the
machine's description, medians with their spread, and markdown tables.

Not a benchmark itself, and not public API: a module the scripts next to it import.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

__all__ = [
    "ReadRoof",
    "home_relative",
    "as_tightfit_run_threads",
    "last_level_cache_bytes",
    "load_average",
    "machine",
    "machine_lines",
    "markdown_table",
    "module_bytes",
    "repository_state",
    "spread",
    "tensor_bytes",
    "wait_for_quiet",
]

GIB = 1 << 30


class ReadRoof:
    """The machine's read bandwidth at the current torch thread count: ``torch.sum`` over a
    float32 buffer of ``nbytes`` (1 GiB by default: far larger than the caches), a
    read-only reduction that touches each byte once.

    The buffer is allocated and written once (its pages faulted in) and kept, so that
    :meth:`measure` can be called between rounds of a benchmark. Each call sums the buffer
    ``repeat`` times, chunk by chunk (``chunk`` bytes, 64 MiB: each sum a few
    milliseconds, as long as one call of the layers it bounds), timing each chunk; its
    figure (bytes per second) is the chunk's bytes over the median chunk time, so that a
    burst of other work on a shared machine moves it as little as it moves the medians it
    is compared with. :attr:`samples` collects one figure per call; :attr:`bandwidth` is
    their median.
    """

    def __init__(self, nbytes: int = GIB, repeat: int = 3, chunk: int = 64 << 20) -> None:
        if nbytes < chunk or repeat < 1 or chunk < 4:
            raise ValueError(f"need nbytes >= chunk >= 4 and repeat >= 1, got {nbytes}, {chunk}, {repeat}")
        self.buffer = torch.ones(nbytes // 4, dtype=torch.float32)
        self.chunks = list(self.buffer.split(chunk // 4))
        if self.chunks[-1].numel() != chunk // 4:
            self.chunks.pop()
        self.nbytes = self.buffer.numel() * 4
        self.chunk = chunk
        self.repeat = repeat
        self.samples: list[float] = []

    def measure(self) -> float:
        """One sample, in bytes per second."""
        self.buffer.sum()  # warm: the reduction's code and the pages
        seconds = []
        for _ in range(self.repeat):
            for part in self.chunks:
                start = time.perf_counter()
                part.sum()
                seconds.append(time.perf_counter() - start)
        sample = self.chunk / statistics.median(seconds)
        self.samples.append(sample)
        return sample

    @property
    def bandwidth(self) -> float:
        if not self.samples:
            self.measure()
        return statistics.median(self.samples)

    def describe(self) -> str:
        low, high = min(self.samples), max(self.samples)
        return (
            f"{self.bandwidth / 1e9:.1f} GB/s (median of {len(self.samples)} samples, {low / 1e9:.1f}-{high / 1e9:.1f}; "
            f"torch.sum over a {self.nbytes / GIB:.0f} GiB float32 buffer in {self.chunk >> 20} MiB chunks, median "
            f"chunk, {torch.get_num_threads()} threads)"
        )

    def release(self) -> None:
        """Free the buffer; the samples stay."""
        self.buffer = torch.empty(0)
        self.chunks = []


def as_tightfit_run_threads() -> str:
    """Run this script under the threading policy the ``tightfit`` command sets before
    torch loads (``tightfit_launcher.THREAD_DEFAULTS``: OpenMP's waiting threads spin
    briefly, then sleep). The OpenMP runtime reads them once, when it loads, so where they
    are missing the script starts again (``os.execv``) with them set; where the user set
    one, theirs is kept. Returns the policy, for the report.

    On a machine other work shares it decides the figures: spinning threads and the other
    processes slow each other down, and every 2-thread call waits for a descheduled
    thread (measured here, 2 cores, load 6: a one-token nf4 matmul of 2048 x 5632 took
    1.5 ms passive, 16 ms spinning; bf16 2.5 ms against 16 ms)."""
    import sys

    from tightfit_launcher import THREAD_DEFAULTS, thread_defaults

    missing = thread_defaults(os.environ)
    if missing:
        os.environ.update(missing)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    return ", ".join(f"{name}={os.environ[name]}" for name in THREAD_DEFAULTS if name in os.environ)


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``."""
    return statistics.median(values), min(values), max(values)


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``/proc/loadavg`` gives them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def _cpuinfo() -> tuple[str, set[str]]:
    name, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name in ("", platform.machine(), platform.processor()):
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of cpu0 (sysfs), in bytes; None where unknown."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else None


def machine() -> dict[str, str]:
    """The machine a run measured, for the results' header."""
    name, flags = _cpuinfo()
    cache = last_level_cache_bytes()
    return {
        "cpu": name,
        "cores": str(os.cpu_count()),
        "flags": ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx2", "avx512f", "avx512_vnni")),
        "last-level cache": f"{cache / (1 << 20):.0f} MiB" if cache else "n/a",
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
    }


def repository_state() -> str:
    """The commit the tightfit source is at, and whether ``src/`` differs from it (kernels
    others are writing in the same tree count in the figures)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("log", "-1", "--format=%h %s")[:72] or "unknown"
    changed = git("status", "--porcelain", "--", "src")
    count = len(changed.splitlines())
    return f"{commit}" + (f"; {count} files under src/ differ from it (uncommitted)" if count else "; src/ clean")


def machine_lines(extra: dict[str, str]) -> list[str]:
    """Markdown bullet lines: :func:`machine`, the repository's state, then ``extra``."""
    return [f"- {key}: {value}" for key, value in {**machine(), "tightfit at": repository_state(), **extra}.items()]


def home_relative(path: Path) -> str:
    """``path`` with the home folder written ``~``: results name no machine's folders."""
    home = str(Path.home())
    return "~" + str(path)[len(home) :] if str(path).startswith(home) else str(path)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; ``align`` holds one of ``l``/``r`` per column (default: the first
    column left, the others right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    rule = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of ``tensors`` (None skipped), a tensor given twice counted once."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def module_bytes(module: torch.nn.Module) -> int:
    """What ``module`` stores: parameters, buffers and its quantized layers' tensors held
    outside those (scales, maps: :func:`tightfit.quant.unregistered_tensors`)."""
    from tightfit.quant import unregistered_tensors

    return tensor_bytes([*module.parameters(), *module.buffers(), *unregistered_tensors(module)])


def add_quiet_load_option(parser) -> None:
    """``--quiet-load``, which both benchmarks pass to :func:`wait_for_quiet`."""
    parser.add_argument(
        "--quiet-load",
        type=float,
        default=None,
        help="first wait (up to 30 min) until the 1-minute load average is at most this (a shared machine)",
    )


def wait_for_quiet(max_load: float | None, timeout: float = 1800.0, poll: float = 10.0) -> str:
    """Wait until the 1-minute load average is at most ``max_load`` (None: do not wait), at
    most ``timeout`` seconds; returns what happened, for the report."""
    if max_load is None:
        return "not waited for"
    start = time.monotonic()
    while True:
        try:
            load = float(Path("/proc/loadavg").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return "load average unreadable; not waited for"
        waited = time.monotonic() - start
        if load <= max_load:
            return f"waited {waited:.0f} s for a 1-minute load average <= {max_load} (was {load})"
        if waited >= timeout:
            return f"gave up after {waited:.0f} s waiting for a 1-minute load average <= {max_load} (was {load})"
        time.sleep(poll)
