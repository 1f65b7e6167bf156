"""NVIDIA CUDA and AMD ROCm (a ROCm build of torch reports itself through ``torch.cuda``)."""

from __future__ import annotations

import dataclasses

import torch

from tightfit.backends._accelerator import AcceleratorBackend
from tightfit.backends.base import Capabilities

__all__ = ["CUDABackend"]


class CUDABackend(AcceleratorBackend):
    """CUDA devices; named ``rocm`` on a ROCm build so users see what they run."""

    name = "cuda"
    device_type = "cuda"
    priority = 100

    def __init__(self) -> None:
        if getattr(torch.version, "hip", None):
            self.name = "rocm"

    def _compute_dtypes(self) -> frozenset[torch.dtype]:
        compute = {torch.float32, torch.float16}
        if torch.cuda.is_bf16_supported():
            compute.add(torch.bfloat16)
        if self.name == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
            compute |= {torch.float8_e4m3fn, torch.float8_e5m2}
        return frozenset(compute)

    def _capabilities(self) -> Capabilities:
        return dataclasses.replace(super()._capabilities(), paged_memory=True)  # cudaMallocManaged / hipMallocManaged
