"""The native kernel paths a test pins in turn, so one machine tests every path it can run:
each instruction-set path (the AVX-512 ones with and without VNNI) and none (the reference),
and the float bound two sums of the same scaled products meet."""

from __future__ import annotations

import pytest
import torch

from tightfit.ops import _native

#: (path, VNNI): each native path, the AVX-512 ones with and without VNNI, and none.
KERNELS = [(path, vnni) for path in (*_native.PATHS, "none") for vnni in ((True, False) if "512" in path else (True,))]


@pytest.fixture(params=KERNELS, ids=lambda kernel: f"{kernel[0]}{'' if kernel[1] else '-no-vnni'}")
def kernel(request, monkeypatch):
    """Pins a path (and the VNNI switch) for the test; skips a path this CPU cannot run."""
    path, vnni = request.param
    if path != "none" and not _native.runnable(path):
        pytest.skip(f"this CPU lacks {path}")
    monkeypatch.setenv(_native.PATH_VARIABLE, path)
    monkeypatch.setattr(_native, "VNNI", vnni)
    return request.param


def sum_order_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Largest |got - reference| two float32 sums of the same K scaled products may differ
    by in any order, each product's two scalings rounded too: (2K + 4) 2**-24 sum |w x|."""
    magnitude = x.double().abs() @ weight.double().abs().t()
    return magnitude * (2 * weight.shape[1] + 4) * 2.0**-24 + 1e-30
