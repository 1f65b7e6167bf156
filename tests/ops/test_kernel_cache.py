"""The numba CPU kernels compile once per machine, not once per process: a second fresh
process loads every one from numba's on-disk cache and adds no cache file.

(numba keys a cached kernel by a hash of its closure's cells; a jitted helper captured
in a closure pickles with a new uuid in each process, so such kernels never hit.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

#: Every cached CPU kernel, by function name; the probe below runs each once.
KERNELS = {
    "quantize",
    "dequantize",
    "gemv_4bit",
    "gather",
    "vectorwise_quant",
    "vectorwise_quant_parallel",
    "mm_dequant",
    "mm_dequant_parallel",
    "few_rows",
    "any_32bit",
}

PROBE = """
import gc, hashlib, json
import torch
import tightfit
import tightfit.optim
from tightfit.ops import _cpu_int8_rows
from numba.core.registry import CPUDispatcher

torch.set_num_threads(2)
A = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
results = []
results += tightfit.ops.quantize_blockwise(A, blocksize=64)
results.append(tightfit.ops.dequantize_blockwise(results[0], results[1], blocksize=64))
packed, absmax = tightfit.ops.quantize_4bit(A, blocksize=64, quant_type="nf4")
results.append(tightfit.ops.dequantize_4bit(packed, absmax, blocksize=64, quant_type="nf4", shape=A.shape))
results.append(tightfit.ops.gemv_4bit(A[:1], packed, A.shape, absmax, blocksize=64, quant_type="nf4"))
x = torch.linspace(-300, 300, 1 << 15).to(torch.bfloat16)  # the cast kernels start at 2**15 values
results.append(tightfit.ops.cast(tightfit.ops.cast(x, torch.float8_e4m3fn), torch.bfloat16))
product = torch.arange(-128, 128, dtype=torch.int32).reshape(4, 64)
for parallel_min in (1 << 62, 0):  # one thread, then the parallel drivers
    _cpu_int8_rows.PARALLEL_MIN = parallel_min
    codes, row_stats, outlier_cols = tightfit.ops.int8_vectorwise_quant(A, 1.5)
    results += [codes, row_stats, outlier_cols]
    results.append(tightfit.ops.int8_mm_dequant(product, A[:, 0].abs(), A[0].abs(), torch.float16))
results.append(tightfit.ops.int8_linear_matmul(codes[:2], codes))  # TIGHTFIT_CPU_INT8_PATH=few_rows
p = A.reshape(-1).clone()
optimizer = tightfit.optim.Adam([p], optim_bits=32)  # one optimizer kernel: they are made alike
p.grad = A.reshape(-1) * 0.01
optimizer.step()
results.append(p.clone())

digest = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in results)).hexdigest()
kernels = {}
for obj in gc.get_objects():
    if isinstance(obj, CPUDispatcher) and obj.py_func.__module__.startswith("tightfit"):
        stats = obj.stats
        if obj._cache.__class__.__name__ != "NullCache" and (stats.cache_hits or stats.cache_misses):  # cached, run
            kernels[obj.py_func.__name__] = [len(stats.cache_hits), len(stats.cache_misses)]
print(json.dumps({"kernels": kernels, "digest": digest}))
"""


def _run_probe(cache: Path) -> dict:
    env = dict(
        os.environ,
        NUMBA_CACHE_DIR=str(cache),
        NUMBA_NUM_THREADS="2",
        TIGHTFIT_CPU_INT8_PATH="few_rows",
        TIGHTFIT_CPU_KERNEL_PATH="none",
    )
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cache_files(cache: Path) -> list[str]:
    return sorted(str(path.relative_to(cache)) for path in cache.rglob("*") if path.suffix in (".nbi", ".nbc"))


def test_a_second_process_loads_every_kernel_from_the_cache(tmp_path):
    cache = tmp_path / "numba"
    first = _run_probe(cache)
    assert KERNELS <= set(first["kernels"]), first["kernels"]
    assert all(misses for _, misses in first["kernels"].values()), first["kernels"]  # compiled: the cache was empty
    files = _cache_files(cache)
    assert any(name.endswith(".nbc") for name in files)  # written where NUMBA_CACHE_DIR says

    second = _run_probe(cache)
    assert set(second["kernels"]) == set(first["kernels"])
    compiled = {name: counts for name, counts in second["kernels"].items() if counts[1] or not counts[0]}
    assert compiled == {}, f"[hits, misses] of kernels not loaded from the cache: {compiled}"
    assert second["digest"] == first["digest"]  # the cached kernels compute what the compiled ones did
    assert _cache_files(cache) == files  # no new entry: stale versions cannot pile up
