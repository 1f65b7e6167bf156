"""Module hooks: a hook registry for any ``nn.Module``, layerwise casting (store float8,
compute bf16 / fp16 / fp32) and offloading (store on the CPU or on disk, compute on the
device, prefetch the next unit); region hints ride on the same registry
(:mod:`tightfit.hooks.hints`).

Hooks compose: apply layerwise casting, then offloading, to keep float8 weights off the
device and compute each layer in bf16 on it.
"""

from tightfit._deprecation import renamed
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
from tightfit.hooks.hints import REGION_HINTS, HintHook
from tightfit.hooks.offload import (
    OFFLOAD_TARGETS,
    OFFLOADING,
    OFFLOADING_SCHEDULE,
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
    "HintHook",
    "HookRegistry",
    "LAYERWISE_CASTING",
    "LayerwiseCastingHook",
    "ModuleHook",
    "OFFLOADING",
    "OFFLOADING_SCHEDULE",
    "OFFLOAD_TARGETS",
    "OffloadFileError",
    "OffloadHook",
    "REGION_HINTS",
    "SCALES",
    "STORAGE_DTYPES",
    "apply_layerwise_casting",
    "apply_offloading",
    "remove_layerwise_casting",
    "remove_offloading",
    "resident_bytes",
]


__getattr__ = renamed(
    __name__, STORAGES=("OFFLOAD_TARGETS (where offload_to= may put weights)", lambda: OFFLOAD_TARGETS)
)
