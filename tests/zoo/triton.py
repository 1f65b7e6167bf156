"""Where the Triton kernels' tests run: a CUDA GPU, or the CPU under Triton's interpreter
(TRITON_INTERPRET=1, which tests/conftest.py sets where no GPU is); elsewhere they skip."""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> torch.device:
    """The device the calling test module's kernels run on; skips the module where none is."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    pytest.skip("the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)
