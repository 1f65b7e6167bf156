"""Small native CPU kernels, compiled at first use and cached (D10, "Fast kernels").

The C sources beside this module (``native/*.c``) are built into one shared library per
instruction-set path, with the machine's C compiler (``$CC``, else ``cc``), and loaded with
ctypes. A build is keyed by the sources, the flags and the compiler's version, and kept in
``<cache>/kernels`` (``$TIGHTFIT_CACHE_DIR``, default ``~/.cache/tightfit``), so later
processes load it in milliseconds. Where no compiler or no build works, callers fall back
to their numba or reference kernel, with the one-time warning of D1.

Paths: ``avx512vbmi`` (AVX-512 F/BW/VL/DQ and VBMI's byte permutes, which decode 8-bit
codes through a 256-entry table faster than gathers), ``avx512`` (the same without VBMI),
``avx2`` (AVX2, FMA, F16C), ``portable`` (plain C
the compiler vectorizes for its baseline: SSE2 on x86-64, NEON on ARM). The CPU picks,
capped by the capability torch itself runs with (so ``ATEN_CPU_CAPABILITY=avx2`` caps
both); ``TIGHTFIT_CPU_KERNEL_PATH`` pins one (``auto``, the three paths, or ``none`` for
no native kernels), so every path is tested on any machine that can execute it. The
libraries link OpenMP, which resolves to the runtime torch has loaded: one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from tightfit._files import cache_dir

__all__: list[str] = []

PATH_VARIABLE = "TIGHTFIT_CPU_KERNEL_PATH"
PATHS = ("avx512vbmi", "avx512", "avx2", "portable")
#: Whether the AVX-512 kernels take VNNI's byte dot products where the CPU has it (tests turn
#: it off to run the loops without it on the same CPU).
VNNI = True

#: What each path compiles with, and the CPU flags (as /proc/cpuinfo names them) it needs.
_AVX512 = ["-DTF_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
_FLAGS = {
    "avx512vbmi": [*_AVX512, "-DTF_VBMI", "-mavx512vbmi"],
    "avx512": _AVX512,
    "avx2": ["-DTF_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}
_NEEDS = {
    "avx512vbmi": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
}
#: -ffp-contract=off: scalar code rounds each product and sum as the reference does (the
#: double-quantized scales decode bit for bit); the vector loops use explicit FMAs.
#: -fno-math-errno: sqrtf (correctly rounded either way) vectorizes when it need not set errno.
_COMMON_FLAGS = [
    "-O3",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-std=c11",
]  # -shared only matters at the link
_SOURCE_DIR = Path(__file__).with_name("native")

#: ctypes signatures of the exported functions, by name.
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "tf_gemv_blockwise": [
        _PTR,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _PTR,
        _PTR,
        _I64,
        _F32,
        _PTR,
        _I64,
        _I64,
        _I64,
        _I64,
        _PTR,
        _I64,
        _I64,
    ],
    "tf_gemv_4bit_int8": [
        _PTR,
        _PTR,
        _PTR,
        _PTR,
        _PTR,
        _PTR,
        _I64,
        _F32,
        _PTR,
        _I64,
        _I64,
        _I64,
        _I64,
        _PTR,
        _I64,
        _I64,
        _I64,
    ],
    "tf_gemv_8bit_int8": [
        *[_PTR] * 6,  # x, w, absmax, qabsmax, code2, absmax2
        _I64,
        _F32,
        _PTR,  # table16
        _F32,  # unit
        *[_I64] * 4,  # M, N, K, blocksize
        _PTR,
        *[_I64] * 3,  # threads, vnni, dtype
    ],
    "tf_dequantize_blockwise": [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _I64, _I64],
    "tf_int8_matmul_rows": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR],
    "tf_int8_quant_rows": [_PTR, _I64, _I64, _I64, _F32, _PTR, _PTR, _PTR, _PTR],
    "tf_int8_dequant_rows": [_PTR, _I64, _I64, _PTR, _PTR, _F32, _PTR, _I64, _PTR, _I64],
    "tf_int8_linear_rows": [
        _PTR,
        _I64,
        _I64,
        _I64,
        _F32,
        _PTR,
        _I64,
        _PTR,
        _F32,
        _PTR,
        _I64,
        _PTR,
        _I64,
        _I64,
        _I64,
        _PTR,
        _PTR,
        _PTR,
        _PTR,
        _PTR,
    ],
    "tf_optimizer_8bit": [
        _I64,  # rule
        _PTR,
        _I64,  # g, its dtype
        _PTR,
        _I64,  # p, its dtype
        *[_PTR] * 12,  # codes, absmax, maps, search tables (three states)
        _I64,  # n
        _PTR,  # constants
        _I64,  # threads
    ],
    "tf_optimizer_32bit": [
        _I64,  # rule
        _PTR,
        _I64,  # g, its dtype
        _PTR,
        _I64,  # p, its dtype
        *[_PTR] * 3,  # the states
        _I64,  # n
        _PTR,  # constants
        _I64,  # threads
    ],
    "tf_gemv_float8": [_PTR, _PTR, _I64, _PTR, _I64, _F32, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64],
}

#: The kernels' codes for the float dtypes they read and write as torch rounds (native/dtypes.h).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

#: Result types of the functions that return one (the others return nothing).
_RESULTS = {"tf_int8_linear_rows": _I64}

_build_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: /proc/cpuinfo where there is one, else what torch's own
    capability implies (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return _NEEDS["avx512"]
    return _NEEDS["avx2"] if capability == "AVX2" else frozenset()


def pinned_path() -> str | None:
    """The path ``TIGHTFIT_CPU_KERNEL_PATH`` pins ("none": no native kernels), or None for auto."""
    value = os.environ.get(PATH_VARIABLE, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in (*PATHS, "none"):
        raise ValueError(f"{PATH_VARIABLE}={value!r} is not a path; accepted: auto, {', '.join(PATHS)}, none")
    return value


def runnable(path: str) -> bool:
    """Whether this CPU can execute ``path``'s instructions."""
    return _NEEDS[path] <= cpu_flags()


def selected_path() -> str | None:
    """The path the native kernels take now (None: none), by the pin or by the CPU."""
    pinned = pinned_path()
    if pinned == "none":
        return None
    if pinned is not None:
        if not runnable(pinned):
            missing = ", ".join(sorted(_NEEDS[pinned] - cpu_flags()))
            raise RuntimeError(f"{PATH_VARIABLE}={pinned} needs CPU features this CPU lacks: {missing}")
        return pinned
    capability = torch.backends.cpu.get_cpu_capability()
    for path in ("avx512vbmi", "avx512"):
        if capability.startswith("AVX512") and runnable(path):
            return path
    if capability.startswith(("AVX512", "AVX2")) and runnable("avx2"):
        return "avx2"
    return "portable"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _build_key(compiler: str, path: str, sources: list[Path]) -> str:
    digest = hashlib.sha256()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    for part in (version, path, " ".join(_COMMON_FLAGS + _FLAGS[path])):
        digest.update(part.encode())
    for source in sources:
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def _build(path: str) -> Path:
    """The cached library for ``path``, compiled first where it is not there yet."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC') or 'cc'} is not on PATH)")
    sources = sorted(_SOURCE_DIR.glob("*.c"))
    headers = sorted(_SOURCE_DIR.glob("*.h"))
    folder = cache_dir() / "kernels"
    target = folder / f"tightfit-{path}-{_build_key(compiler, path, sources + headers)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        flags = [*_COMMON_FLAGS, *_FLAGS[path]]
        objects = [os.path.join(scratch, f"{source.stem}.o") for source in sources]
        # One compiler per source at once (the first build is on a user's critical path), then a link.
        _run_all([[compiler, *flags, "-c", str(source), "-o", obj] for source, obj in zip(sources, objects)])
        partial = os.path.join(scratch, "library.so")
        _run_all([[compiler, *flags, *objects, "-o", partial]])
        os.replace(partial, target)  # atomic: a concurrent process sees the whole library or none
    return target


def _run_all(commands: list[list[str]]) -> None:
    """Run ``commands`` side by side; RuntimeError with the compiler's message if one fails."""
    running = [
        (command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for command in commands
    ]
    failures = []
    for command, process in running:
        try:
            _, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        if process.returncode != 0:
            failures.append(f"{' '.join(command)} failed: {stderr.strip()[-2000:]}")
    if failures:
        raise RuntimeError("; ".join(failures))


@functools.cache
def _load(path: str) -> tuple[ctypes.CDLL | None, str | None]:
    try:
        with _build_lock:
            library = ctypes.CDLL(str(_build(path)))
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, _RESULTS.get(name)
    except (
        OSError,
        RuntimeError,
        AttributeError,
        subprocess.SubprocessError,
    ) as error:  # AttributeError: a symbol missing
        return None, f"the native {path} kernels could not be built ({type(error).__name__}: {error})"
    return library, None


def library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, its path) for the selected path, or (None, why not)."""
    path = selected_path()
    if path is None:
        return None, f"{PATH_VARIABLE}=none"
    loaded, why_not = _load(path)
    return (loaded, path) if loaded is not None else (None, why_not or "")
