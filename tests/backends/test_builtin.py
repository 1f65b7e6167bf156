"""Built-in backends: CPU figures, capability declarations, device arguments."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.backends import FLOAT8_DTYPES


def test_cpu_memory_figures_are_real():
    info = tightfit.backends.get("cpu").memory()
    assert info.source == "process RSS"
    assert info.total > info.free > 0
    assert info.peak >= info.allocated > 0


def test_cpu_peak_reset_and_growth():
    cpu = tightfit.backends.get("cpu")
    cpu.reset_peak_memory()
    before = cpu.memory().peak
    block = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB, touched
    after = cpu.memory().peak
    del block
    assert after - before >= 60 * 1024 * 1024


def test_cpu_capabilities_store_every_float8_kind():
    caps = tightfit.backends.get("cpu").capabilities()
    assert FLOAT8_DTYPES <= caps.storage_dtypes
    assert torch.bfloat16 in caps.compute_dtypes and caps.unified_memory


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        ("cuda:0", ValueError, "is not a cpu device"),
        (1.5, TypeError, "device must be torch.device, str or None"),
        ("bogus", ValueError, "is not a valid torch device"),
    ],
)
def test_backend_methods_reject_foreign_devices(device, error, match):
    cpu = tightfit.backends.get("cpu")
    for method in (cpu.memory, cpu.reset_peak_memory, cpu.synchronize):
        with pytest.raises(error, match=match):
            method(device)


def test_device_index_is_validated():
    cpu = tightfit.backends.get("cpu")
    with pytest.raises(ValueError, match="index must be >= 0, got -1"):
        cpu.device(-1)
    with pytest.raises(TypeError, match="index must be an int or None, got str"):
        cpu.device("0")
    assert cpu.device() == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "xpu", "mps", "hpu"])
def test_accelerator_backend_when_present(name):
    entry = next(e for e in tightfit.backends.all_backends() if e.entry_point == name)
    assert entry.backend is not None and entry.error is None
    if not entry.available:
        pytest.skip(f"no {name} device on this machine")
    backend = entry.backend
    backend.reset_peak_memory()
    x = torch.ones(1024, 1024, device=backend.device(0))
    backend.synchronize()
    info = backend.memory()
    assert info.allocated >= x.numel() * 4
    if info.peak is not None:
        assert info.peak >= info.allocated
