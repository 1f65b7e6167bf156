"""Module hooks: a hook registry for any ``nn.Module``, layerwise casting (store float8,
compute bf16 / fp16 / fp32) and offloading (store on the CPU or on disk, compute on the
device, prefetch the next unit).

Hooks compose: apply layerwise casting, then offloading, to keep float8 weights off the
device and compute each layer in bf16 on it.
"""

from tightfit.hooks.casting import (
    COMPUTE_DTYPES,
    DEFAULT_SKIP,
    LAYERWISE_CASTING,
    SCALES,
    STORAGE_DTYPES,
    LayerwiseCastingHook,
    apply_layerwise_casting,
    remove_layerwise_casting,
)
from tightfit.hooks.offload import (
    OFFLOADING,
    OFFLOADING_SCHEDULE,
    STORAGES,
    OffloadFileError,
    OffloadHook,
    apply_offloading,
    remove_offloading,
    resident_bytes,
)
from tightfit.hooks.registry import HookRegistry, ModuleHook

__all__ = [
    "COMPUTE_DTYPES",
    "DEFAULT_SKIP",
    "HookRegistry",
    "LAYERWISE_CASTING",
    "LayerwiseCastingHook",
    "ModuleHook",
    "OFFLOADING",
    "OFFLOADING_SCHEDULE",
    "OffloadFileError",
    "OffloadHook",
    "SCALES",
    "STORAGES",
    "STORAGE_DTYPES",
    "apply_layerwise_casting",
    "apply_offloading",
    "remove_layerwise_casting",
    "remove_offloading",
    "resident_bytes",
]
