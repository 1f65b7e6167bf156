"""Blockwise 8-bit and 4-bit (NF4 / FP4) quantization ops, bit-compatible with bitsandbytes.

A tensor is cut into contiguous blocks of ``blocksize`` values (the last may be
partial); each block is scaled by its absolute maximum and every value becomes the
index of the nearest entry of a code (ties go to the lower entry). The reference
kernels below are the specification; see docs/quantization.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from collections.abc import Sequence

import torch

from tightfit._validate import has_values
from tightfit.ops import _arg_checks as checks
from tightfit.ops import _cpu_blockwise as cpu
from tightfit.ops._arg_checks import BLOCKSIZES_4BIT, BLOCKSIZES_8BIT, FLOAT_DTYPES, block_count, packed_bytes
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.codes import QUANT_TYPES_4BIT, code_4bit, dynamic_map, real_constant

__all__ = [
    "BLOCKSIZES_4BIT",
    "BLOCKSIZES_8BIT",
    "FLOAT_DTYPES",
    "dequantize_4bit",
    "dequantize_blockwise",
    "quantize_4bit",
    "quantize_blockwise",
]


# -- reference kernels (the specification) ----------------------------------------------


def _scale_blocks(A: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values scaled into [-1, 1], absmax per block), exactly as bitsandbytes computes them."""
    flat = A.reshape(-1).float()
    full = flat.numel() - flat.numel() % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1) if blocks.numel() else torch.zeros(0, device=A.device)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).unsqueeze(1)), -1, 1).reshape(-1)
    if full < flat.numel():
        tail_max = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail_max.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / tail_max, -1, 1)])
    return scaled, absmax


def _block_scales(absmax: torch.Tensor, numel: int, blocksize: int) -> torch.Tensor:
    return absmax.float().repeat_interleave(blocksize)[:numel]


def _quantize_blockwise_reference(
    A: torch.Tensor, code: torch.Tensor, blocksize: int
) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, absmax = _scale_blocks(A, blocksize)
    q = torch.bucketize(scaled, cpu.midpoints(code), out_int32=True).to(torch.uint8)
    return q.reshape(A.shape), absmax


def _dequantize_blockwise_reference(
    A: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, dtype: torch.dtype
) -> torch.Tensor:
    values = code.float()[A.reshape(-1).long()] * _block_scales(absmax, A.numel(), blocksize)
    return values.reshape(A.shape).to(dtype)


@functools.cache
@real_constant
def _code_on(name: str, device: torch.device) -> torch.Tensor:
    """The dynamic map ("dynamic"), its unsigned form ("udynamic", 8-bit optimizers' second
    moments) or a 4-bit code on ``device``, copied there once: kernels only read it, and a
    host-to-device copy per call would stall a GPU's queue."""
    if name in ("dynamic", "udynamic"):
        return dynamic_map(signed=name == "dynamic").to(device)
    return code_4bit(name).to(device)


@functools.cache
@real_constant
def _sorted_code(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    code = code_4bit(quant_type)
    # The CPU's argsort, as bitsandbytes' reference calls it, decides FP4's +0/-0 tie;
    # a GPU's sort may order the tie the other way.
    order = torch.argsort(code)
    return code[order].to(device), order.to(device)


def _pack(nibbles: torch.Tensor) -> torch.Tensor:
    if nibbles.numel() % 2:
        raise ValueError("internal: an odd number of nibbles reached _pack")  # callers pad first
    pairs = nibbles.to(torch.uint8).reshape(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def _as_storage(packed: torch.Tensor, quant_storage: torch.dtype) -> torch.Tensor:
    return packed.view(quant_storage).unsqueeze(1)


def _quantize_4bit_reference(
    A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    scaled, absmax = _scale_blocks(A, blocksize)
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))  # a scaled zero
    sorted_code, order = _sorted_code(quant_type, A.device)
    q = order[torch.bucketize(scaled, cpu.midpoints(sorted_code), out_int32=True)]
    return _as_storage(_pack(q), quant_storage), absmax


def _unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    flat = packed.reshape(-1).view(torch.uint8)
    return torch.stack([flat >> 4, flat & 15], dim=1).reshape(-1)[:numel].long()


def _dequantize_4bit_reference(
    A: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    numel = math.prod(shape)
    code = _code_on(quant_type, A.device)
    values = code[_unpack(A, numel)] * _block_scales(absmax, numel, blocksize)
    return values.reshape(shape).to(dtype)


# -- fake kernels ---------------------------------------------------------------------------


def _quantize_blockwise_fake(A, code, blocksize):
    return torch.empty(A.shape, dtype=torch.uint8, device=A.device), torch.empty(
        block_count(A.numel(), blocksize), device=A.device
    )


def _dequantize_blockwise_fake(A, absmax, code, blocksize, dtype):
    return torch.empty(A.shape, dtype=dtype, device=A.device)


def _quantize_4bit_fake(A, blocksize, quant_type, quant_storage):
    packed = torch.empty(packed_bytes(A.numel()) // quant_storage.itemsize, 1, dtype=quant_storage, device=A.device)
    return packed, torch.empty(block_count(A.numel(), blocksize), device=A.device)


def _dequantize_4bit_fake(A, absmax, blocksize, quant_type, shape, dtype):
    return torch.empty(shape, dtype=dtype, device=A.device)


# -- CPU kernels ----------------------------------------------------------------------------


def _check_sorted(code: torch.Tensor, device: torch.device, name: str = "code") -> None:
    """The nearest-entry search needs a code (``name``) sorted ascending. Reading it costs a
    sync on an accelerator, so the dynamic maps, sorted by construction, are not read."""
    if any(code is _code_on(shared, device) for shared in ("dynamic", "udynamic")):
        return
    if not bool((code[1:] >= code[:-1]).all()):
        raise ValueError(f"{name} must be sorted ascending (nearest-entry search assumes it)")


def _quantize_blockwise_cpu(A, code, blocksize):
    _check_sorted(code, A.device)
    return cpu.quantize_cpu(
        "quantize_blockwise", A, blocksize, code, None, lambda: _quantize_blockwise_reference(A, code, blocksize)
    )


def _dequantize_blockwise_cpu(A, absmax, code, blocksize, dtype):
    return cpu.dequantize_8bit_cpu(
        A, absmax, code, blocksize, dtype, lambda: _dequantize_blockwise_reference(A, absmax, code, blocksize, dtype)
    )


def _quantize_4bit_cpu(A, blocksize, quant_type, quant_storage):
    sorted_code, order = _sorted_code(quant_type, A.device)
    packed, absmax = cpu.quantize_cpu(
        "quantize_4bit",
        A,
        blocksize,
        sorted_code,
        order,
        lambda: _quantize_4bit_reference(A, blocksize, quant_type, torch.uint8),
    )
    return _as_storage(packed.reshape(-1), quant_storage), absmax


def _dequantize_4bit_cpu(A, absmax, blocksize, quant_type, shape, dtype):
    return cpu.dequantize_4bit_cpu(
        A,
        absmax,
        code_4bit(quant_type),
        blocksize,
        shape,
        dtype,
        lambda: _dequantize_4bit_reference(A, absmax, blocksize, quant_type, shape, dtype),
    )


# -- GPU kernels (Triton, imported at the first call) -------------------------------------


def _triton():
    return importlib.import_module("tightfit.ops._triton_blockwise")


@functools.cache
@real_constant
def _named_search(name: str, device: torch.device):
    """Search tables for the dynamic maps or a 4-bit code, built once per device."""
    if name in ("dynamic", "udynamic"):
        return _triton().search_tables(dynamic_map(signed=name == "dynamic"), device)
    code, order = _sorted_code(name, torch.device("cpu"))
    return _triton().search_tables(code, device, order)


def _quantize_blockwise_gpu(A, code, blocksize):
    _check_sorted(code, A.device)
    if blocksize not in BLOCKSIZES_8BIT:  # the Triton kernel tiles whole blocks: powers of two up to 4096
        return _quantize_blockwise_reference(A, code, blocksize)
    default = code is _code_on("dynamic", A.device)
    search = _named_search("dynamic", A.device) if default else _triton().search_tables(code, A.device)
    return _triton().quantize(A, blocksize, search, four_bit=False)


def _dequantize_blockwise_gpu(A, absmax, code, blocksize, dtype):
    return _triton().dequantize(A, absmax, code, blocksize, list(A.shape), dtype, four_bit=False)


def _quantize_4bit_gpu(A, blocksize, quant_type, quant_storage):
    packed, absmax = _triton().quantize(A, blocksize, _named_search(quant_type, A.device), four_bit=True)
    return _as_storage(packed, quant_storage), absmax


def _dequantize_4bit_gpu(A, absmax, blocksize, quant_type, shape, dtype):
    return _triton().dequantize(A, absmax, _code_on(quant_type, A.device), blocksize, shape, dtype, four_bit=True)


# -- conformance cases ----------------------------------------------------------------------


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(3 * 4096 + 1001, generator=generator)
    spiky = normal.clone()
    spiky[::97] *= 50
    return {
        "randn full+partial": normal,
        "outliers": spiky,
        "zeros block": torch.cat([torch.zeros(4096), normal[:100]]),
        "tiny": normal[:3] * 1e-30,
        "odd 2d": normal[: 33 * 17].reshape(33, 17),
        "empty": normal[:0],
    }


#: 8-bit blocksizes outside the configs' powers of two, which bitsandbytes accepts too:
#: a full block past 4096 (and larger than the small inputs), not a power of two, one value a block.
_ODD_BLOCKSIZES = (8192, 1000, 1)


def _blockwise_cases() -> list[Case]:
    code = dynamic_map()
    cases = []
    for dtype in FLOAT_DTYPES:
        for name, values in _inputs().items():
            for blocksize in (64, 4096, *_ODD_BLOCKSIZES):
                cases.append(Case(f"{name} {dtype} bs{blocksize}", (values.to(dtype), code, blocksize)))
    return cases


def _dequantize_blockwise_cases() -> list[Case]:
    cases = []
    for case in _blockwise_cases():
        A, code, blocksize = case.args
        q, absmax = _quantize_blockwise_reference(A, code, blocksize)
        cases.append(Case(case.name, (q, absmax, code, blocksize, A.dtype)))
    return cases


def _4bit_cases() -> list[Case]:
    cases = []
    for quant_type in QUANT_TYPES_4BIT:
        for dtype in FLOAT_DTYPES:
            for name, values in _inputs(1).items():
                for blocksize in (32, 64, 4096):
                    cases.append(
                        Case(
                            f"{quant_type} {name} {dtype} bs{blocksize}",
                            (values.to(dtype), blocksize, quant_type, torch.uint8),
                        )
                    )
    return cases


def _dequantize_4bit_cases() -> list[Case]:
    cases = []
    for case in _4bit_cases():
        A, blocksize, quant_type, storage = case.args
        packed, absmax = _quantize_4bit_reference(A, blocksize, quant_type, storage)
        cases.append(Case(case.name, (packed, absmax, blocksize, quant_type, list(A.shape), A.dtype)))
    return cases


_QUANTIZE_BLOCKWISE = define_op(
    "quantize_blockwise",
    _quantize_blockwise_reference,
    fake=_quantize_blockwise_fake,
    cases=_blockwise_cases,
    check=checks.quantize_blockwise,
)
_DEQUANTIZE_BLOCKWISE = define_op(
    "dequantize_blockwise",
    _dequantize_blockwise_reference,
    fake=_dequantize_blockwise_fake,
    cases=_dequantize_blockwise_cases,
    check=checks.dequantize_blockwise,
)
_QUANTIZE_4BIT = define_op(
    "quantize_4bit", _quantize_4bit_reference, fake=_quantize_4bit_fake, cases=_4bit_cases, check=checks.quantize_4bit
)
_DEQUANTIZE_4BIT = define_op(
    "dequantize_4bit",
    _dequantize_4bit_reference,
    fake=_dequantize_4bit_fake,
    cases=_dequantize_4bit_cases,
    check=checks.dequantize_4bit,
)
register_kernel("quantize_blockwise", "cpu", _quantize_blockwise_cpu, label="block scan (numba)")
register_kernel("dequantize_blockwise", "cpu", _dequantize_blockwise_cpu, label="block scan (numba)")
register_kernel("quantize_4bit", "cpu", _quantize_4bit_cpu, label="block scan (numba)")
register_kernel("dequantize_4bit", "cpu", _dequantize_4bit_cpu, label="block scan (numba)")
if importlib.util.find_spec("triton") is not None:  # checked without importing it (D2)
    # "cuda" covers ROCm builds too; other Triton targets are not registered until tested on one.
    register_kernel("quantize_blockwise", "cuda", _quantize_blockwise_gpu, label="block tiles (triton)")
    register_kernel("dequantize_blockwise", "cuda", _dequantize_blockwise_gpu, label="element tiles (triton)")
    register_kernel("quantize_4bit", "cuda", _quantize_4bit_gpu, label="block tiles (triton)")
    register_kernel("dequantize_4bit", "cuda", _dequantize_4bit_gpu, label="element tiles (triton)")


# -- public functions: defaults and value checks, then the op (which checks the rest) ----------


def _reject_non_finite(absmax: torch.Tensor) -> None:
    """Inputs with NaN or inf have no meaningful scale: refuse them rather than emit garbage.
    A skeleton quantized to plan its memory has no values to check."""
    if not has_values(absmax) or torch.compiler.is_compiling():
        return
    if absmax.numel() and not bool(torch.isfinite(absmax).all()):
        block = int((~torch.isfinite(absmax)).nonzero()[0])
        raise ValueError(f"A has NaN or inf values (first in block {block}); quantization needs finite values")


def _code_for(code: torch.Tensor | None, A: object) -> torch.Tensor | None:
    """The dynamic map on A's device for ``code=None``."""
    if code is None and isinstance(A, torch.Tensor):
        return _code_on("dynamic", A.device)
    return code


def quantize_blockwise(
    A: torch.Tensor, code: torch.Tensor | None = None, blocksize: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise quantization: (codes as uint8 shaped like ``A``, float32 absmax per block).

    ``code`` defaults to the dynamic map; ``blocksize`` is any int from 1 to 2**31 - 1
    (bitsandbytes' 8-bit functions accept any too); configs use the powers of two 64..4096.
    Raises ValueError for NaN or inf in ``A``.
    """
    q, absmax = _QUANTIZE_BLOCKWISE(A, _code_for(code, A), blocksize)
    _reject_non_finite(absmax)
    return q, absmax


def dequantize_blockwise(
    A: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor | None = None,
    blocksize: int = 4096,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode 8-bit blockwise codes: ``code[A] * absmax[block]`` in float32, returned as ``dtype``."""
    return _DEQUANTIZE_BLOCKWISE(A, absmax, _code_for(code, A), blocksize, dtype)


def quantize_4bit(
    A: torch.Tensor, blocksize: int = 64, quant_type: str = "fp4", quant_storage: torch.dtype = torch.uint8
) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit blockwise quantization: (packed codes shaped ``(bytes / itemsize, 1)``, float32 absmax).

    Two codes per byte, the first value in the high nibble; an odd count is padded
    with the code of a scaled zero. ``quant_storage`` reinterprets the packed bytes
    (their count must divide evenly). Raises ValueError for NaN or inf in ``A``.
    """
    packed, absmax = _QUANTIZE_4BIT(A, blocksize, quant_type, quant_storage)
    _reject_non_finite(absmax)
    return packed, absmax


def dequantize_4bit(
    A: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int = 64,
    quant_type: str = "fp4",
    shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode packed 4-bit codes into a tensor of ``shape`` and ``dtype``."""
    return _DEQUANTIZE_4BIT(A, absmax, blocksize, quant_type, shape, dtype)
