"""Hostile-input harness for the raw ops (D9): generated arguments, run in a child process.

Each case starts from valid arguments of one op and applies up to two mutations (wrong
lengths, shapes, dtypes, strides, blocksizes, code tables, ``out`` buffers, devices,
non-finite values, zero sizes). A mutation is either harmless (the op must return what
the reference kernel returns on the CPU) or harmful (the op must raise ValueError,
TypeError or RuntimeError). Cases run in a worker process through both entry points,
``torch.ops.tightfit.<op>`` and the direct path ``get_op(name)(...)``, so a crash or a
hang is recorded against the case that caused it instead of ending the campaign.

Outcomes: ``equal`` (a valid case returned the reference's result), ``clean`` (a
harmful case raised a clean error), ``refused`` (a valid case raised), ``unclean``
(another exception type), ``wrong`` (a harmful case returned, a valid case differed from
the reference, or an input was modified), ``hang``, ``crash``. Run it with
``python -m tightfit.ops.fuzz --count N`` (``tightfit._fuzz_campaign`` runs the workers).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tightfit._fuzz_campaign import main
from tightfit.ops import _arg_checks as checks
from tightfit.ops import _cpu_int8
from tightfit.ops._registry import get_op
from tightfit.ops.codes import QUANT_TYPES_4BIT, dynamic_map
from tightfit.ops.optimizer import OPTIMIZER_BLOCKSIZE, OPTIMIZERS, TWO_STATE_OPTIMIZERS

__all__ = ["FuzzCase", "make_case", "run_case"]

CLEAN_ERRORS = (ValueError, TypeError, RuntimeError)
#: dtypes a mutation may swap in (complex and bool included: kernels must not reinterpret them).
_ANY_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)
#: Blocksizes outside the 4-bit set; 1, 63, 100 and 8192 are valid for the 8-bit ops.
_BAD_BLOCKSIZES = (0, -64, 1, 63, 100, 8192, 1 << 31, 1 << 62)
#: Valid 8-bit blocksizes: the configs' powers of two and others bitsandbytes accepts too.
_BLOCKSIZES_8BIT = (*checks.BLOCKSIZES_8BIT, 1, 100, 5000, 8192)


@dataclass
class FuzzCase:
    """One generated call: op name, arguments in schema order, and whether they are valid."""

    op: str
    args: list[Any]
    valid: bool
    label: str
    #: The CPU int8 matmul path pinned for the call ("auto": the CPU's choice); see _cpu_int8.
    int8_path: str = "auto"


class _Builder:
    """Generates one case: a valid base, then mutations that say whether it stays valid."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.generator = torch.Generator().manual_seed(rng.getrandbits(31))
        self.labels: list[str] = []
        self.valid = True

    def floats(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        values = torch.randn(shape, generator=self.generator) * self.rng.choice((1e-3, 1.0, 50.0))
        if values.numel() and self.rng.random() < 0.1:
            values.view(-1)[self.rng.randrange(values.numel())] = self.rng.choice((math.nan, math.inf, -math.inf))
        return values.to(dtype)

    def bytes_(self, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        raw = torch.randint(0, 256, (count,), generator=self.generator, dtype=torch.int32).to(torch.uint8)
        return raw.view(dtype) if count % dtype.itemsize == 0 else raw

    def shape(self, max_rank: int = 3, max_dim: int = 40) -> tuple[int, ...]:
        rank = self.rng.randint(1, max_rank)
        shape = tuple(self.rng.randint(0 if self.rng.random() < 0.1 else 1, max_dim) for _ in range(rank))
        if self.rng.random() < 0.1:
            shape = (self.rng.randint(4000, 9000),)  # several blocks of the largest blocksize
        return shape

    def mutate(self, label: str, harmless: bool) -> None:
        self.labels.append(label)
        self.valid = self.valid and harmless

    def tensor_mutation(
        self,
        args: list[Any],
        index: int,
        name: str,
        valid: Callable[[torch.Tensor], bool],
        *,
        primary: bool = False,
        optional: bool = False,
    ) -> None:
        """One mutation of tensor argument ``index``; ``valid(new)`` says whether the op must accept it
        (the oracle, written from the op's documented contract, not from its checks)."""
        tensor = args[index]
        kind = self.rng.choice(("dtype", "strided", "length", "rank", "not a tensor") + (() if primary else ("meta",)))
        if kind == "dtype":
            dtype = self.rng.choice(_ANY_DTYPES)
            new = tensor.to(dtype) if dtype != torch.float8_e4m3fn else tensor.float().clamp(-448, 448).to(dtype)
        elif kind == "strided":
            spread = torch.empty(tensor.numel() * 2, dtype=tensor.dtype)[::2]
            new = spread.copy_(tensor.reshape(-1)).reshape(tensor.shape) if tensor.dim() else tensor
        elif kind == "length":
            delta = self.rng.choice((-1, 1, 7))
            flat = tensor.reshape(-1)
            new = torch.cat([flat, flat.new_zeros(max(delta, 0))])[: max(flat.numel() + delta, 0)]
        elif kind == "rank":
            new = tensor.reshape(-1, 1) if tensor.dim() == 1 else tensor.reshape(-1)
        elif kind == "meta":
            new = tensor.to("meta")
        else:
            args[index] = self.rng.choice((None, 3, [1.0, 2.0], "x"))
            self.mutate(f"{name} = {args[index]!r}", optional and args[index] is None)
            return
        args[index] = new
        self.mutate(
            f"{name} {kind}: {new.dtype} {tuple(new.shape)} {new.device.type}", new.device.type == "cpu" and valid(new)
        )

    def blocksize(
        self, args: list[Any], index: int, accepted: tuple[int, ...] | None, numel: int | None = None
    ) -> None:
        """A new blocksize, valid if in ``accepted`` (None: the 8-bit ops' range); with ``numel``
        (decoding), it stays valid only if absmax still has one value a block."""
        old, value = args[index], self.rng.choice(_BAD_BLOCKSIZES + (accepted or _BLOCKSIZES_8BIT))
        args[index] = value
        same_blocks = numel is None or (
            value > 0 and checks.block_count(numel, value) == checks.block_count(numel, old)
        )
        in_range = value in accepted if accepted is not None else 1 <= value <= checks.MAX_BLOCKSIZE_8BIT
        self.mutate(f"blocksize {value}", in_range and same_blocks)

    def choice_arg(
        self, args: list[Any], index: int, name: str, values: tuple[Any, ...], accepted: tuple[Any, ...]
    ) -> None:
        value = self.rng.choice(values)
        args[index] = value
        self.mutate(f"{name} {value!r}", value in accepted)

    def which(self, names: tuple[str, ...], most: int = 1) -> list[str]:
        """Up to ``most`` different arguments to mutate; one by default, since arguments are coupled
        (A and absmax, A and shape) and two harmful changes can cancel out."""
        return self.rng.sample(names, self.rng.randint(0, min(most, len(names))))


def _floats_ok(t: torch.Tensor) -> bool:
    return t.dtype in checks.FLOAT_DTYPES


def _absmax_ok(numel: int, blocksize: int) -> Callable[[torch.Tensor], bool]:
    return lambda t: (
        t.dtype in checks.FLOAT_DTYPES and t.dim() == 1 and t.numel() == checks.block_count(numel, blocksize)
    )


def _packed_ok(numel: int) -> Callable[[torch.Tensor], bool]:
    return lambda t: (
        t.dtype in checks.PACKED_DTYPES
        and t.is_contiguous()
        and t.numel() * t.element_size() == checks.packed_bytes(numel)
    )


def _code_ok(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.dim() == 1 and t.numel() == 256


def _absmax(b: _Builder, numel: int, blocksize: int) -> torch.Tensor:
    absmax = torch.rand(checks.block_count(numel, blocksize), generator=b.generator) * 4
    if absmax.numel() and b.rng.random() < 0.1:
        absmax[b.rng.randrange(absmax.numel())] = b.rng.choice(
            (math.nan, math.inf, -1.0, 0.0)
        )  # decodes as the reference does
    return absmax


def _sorted_code(b: _Builder) -> torch.Tensor:
    if b.rng.random() < 0.7:
        return dynamic_map()
    return torch.sort(torch.rand(256, generator=b.generator) * 2 - 1).values


def _quantize_blockwise(b: _Builder) -> list[Any]:
    args = [
        b.floats(b.shape(), b.rng.choice(checks.FLOAT_DTYPES)),
        _sorted_code(b),
        b.rng.choice(_BLOCKSIZES_8BIT),
    ]
    for what in b.which(("A", "code", "blocksize")):
        if what == "A":
            b.tensor_mutation(args, 0, "A", _floats_ok, primary=True)
        elif what == "code" and b.rng.random() < 0.3:
            args[1] = args[1][torch.randperm(256, generator=b.generator)]
            b.mutate("code shuffled", False)
        elif what == "code":
            b.tensor_mutation(args, 1, "code", _code_ok)
        else:
            b.blocksize(args, 2, None)
    return args


def _dequantize_blockwise(b: _Builder) -> list[Any]:
    shape, blocksize = b.shape(), b.rng.choice(_BLOCKSIZES_8BIT)
    A = b.bytes_(math.prod(shape)).reshape(shape)
    args = [A, _absmax(b, A.numel(), blocksize), _sorted_code(b), blocksize, b.rng.choice(checks.FLOAT_DTYPES)]
    for what in b.which(("A", "absmax", "code", "blocksize", "dtype")):
        if what == "A":
            b.tensor_mutation(
                args,
                0,
                "A",
                lambda t: t.dtype == torch.uint8 and checks.block_count(t.numel(), blocksize) == args[1].numel(),
                primary=True,
            )
        elif what == "absmax":
            b.tensor_mutation(args, 1, "absmax", _absmax_ok(A.numel(), blocksize))
        elif what == "code":
            b.tensor_mutation(args, 2, "code", _code_ok)
        elif what == "blocksize":
            b.blocksize(args, 3, None, numel=A.numel())
        else:
            b.choice_arg(args, 4, "dtype", _ANY_DTYPES, checks.FLOAT_DTYPES)
    return args


def _quantize_4bit(b: _Builder) -> list[Any]:
    args = [
        b.floats(b.shape(), b.rng.choice(checks.FLOAT_DTYPES)),
        b.rng.choice(checks.BLOCKSIZES_4BIT),
        b.rng.choice(QUANT_TYPES_4BIT),
        torch.uint8,
    ]
    for what in b.which(("A", "blocksize", "quant_type", "quant_storage")):
        if what == "A":
            b.tensor_mutation(args, 0, "A", _floats_ok, primary=True)
        elif what == "blocksize":
            b.blocksize(args, 1, checks.BLOCKSIZES_4BIT)
        elif what == "quant_type":
            b.choice_arg(args, 2, "quant_type", ("nf5", "", "NF4", "fp4", "nf4"), QUANT_TYPES_4BIT)
        else:
            storage = b.rng.choice(_ANY_DTYPES)
            numel = args[0].numel() if isinstance(args[0], torch.Tensor) else 0
            args[3] = storage
            b.mutate(
                f"quant_storage {storage}",
                storage in checks.PACKED_DTYPES and checks.packed_bytes(numel) % storage.itemsize == 0,
            )
    return args


def _packed_weight(b: _Builder, numel: int) -> torch.Tensor:
    count = checks.packed_bytes(numel)
    storage = b.rng.choice((torch.uint8, torch.uint8, torch.bfloat16, torch.int32))
    return b.bytes_(count, storage).reshape(-1, 1)


def _dequantize_4bit(b: _Builder) -> list[Any]:
    shape, blocksize = list(b.shape()), b.rng.choice(checks.BLOCKSIZES_4BIT)
    numel = math.prod(shape)
    args = [
        _packed_weight(b, numel),
        _absmax(b, numel, blocksize),
        blocksize,
        b.rng.choice(QUANT_TYPES_4BIT),
        shape,
        b.rng.choice(checks.FLOAT_DTYPES),
    ]
    for what in b.which(("A", "absmax", "blocksize", "shape", "dtype")):
        if what == "A":
            b.tensor_mutation(args, 0, "A", _packed_ok(numel), primary=True)
        elif what == "absmax":
            b.tensor_mutation(args, 1, "absmax", _absmax_ok(numel, blocksize))
        elif what == "blocksize":
            b.blocksize(args, 2, checks.BLOCKSIZES_4BIT, numel=numel)
        elif what == "shape":
            args[4] = b.rng.choice(([*shape, 2], [-numel, -1], [1 << 40, 1 << 40], [numel + 2], []))
            new = math.prod(args[4])
            b.mutate(
                f"shape {args[4]}",
                min(args[4], default=0) >= 0
                and checks.packed_bytes(new) == checks.packed_bytes(numel)
                and checks.block_count(new, blocksize) == checks.block_count(numel, blocksize),
            )
        else:
            b.choice_arg(args, 5, "dtype", _ANY_DTYPES, checks.FLOAT_DTYPES)
    return args


def _gemv_4bit(b: _Builder) -> list[Any]:
    rows, cols, blocksize = b.rng.randint(1, 40), b.rng.randint(1, 70), b.rng.choice(checks.BLOCKSIZES_4BIT)
    tokens = b.rng.choice(((cols,), (1, cols), (3, cols), (2, 2, cols)))
    args = [
        b.floats(tokens, b.rng.choice(checks.FLOAT_DTYPES)),
        _packed_weight(b, rows * cols),
        [rows, cols],
        _absmax(b, rows * cols, blocksize),
        blocksize,
        b.rng.choice(QUANT_TYPES_4BIT),
    ]
    for what in b.which(("A", "B", "shape", "absmax", "blocksize")):
        if what == "A":
            b.tensor_mutation(
                args, 0, "A", lambda t: _floats_ok(t) and t.dim() >= 1 and t.shape[-1] == cols, primary=True
            )
        elif what == "B":
            b.tensor_mutation(args, 1, "B", _packed_ok(rows * cols))
        elif what == "shape":
            new = b.rng.choice(([rows, cols + 1], [rows + 1, cols], [0, cols], [rows * cols], [-rows, -cols]))
            args[2] = new
            # one more row can still fit the packed bytes and the blocks (an odd count's pad nibble)
            fits = len(new) == 2 and new[0] > 0 and new[1] == cols
            fits = fits and checks.packed_bytes(new[0] * cols) == checks.packed_bytes(rows * cols)
            fits = fits and checks.block_count(new[0] * cols, blocksize) == checks.block_count(rows * cols, blocksize)
            b.mutate(f"shape {new}", fits)
        elif what == "absmax":
            b.tensor_mutation(args, 3, "absmax", _absmax_ok(rows * cols, blocksize))
        else:
            b.blocksize(args, 4, checks.BLOCKSIZES_4BIT, numel=rows * cols)
    return args


def _nested_scales(b: _Builder, absmax: torch.Tensor) -> list[Any]:
    """Double-quantized block scales, as QuantState stores them: [codes, absmax2, code2, nested_blocksize, offset]."""
    nested_blocksize = b.rng.choice((1, 3, 256))
    count = absmax.numel()
    absmax2 = torch.rand(checks.block_count(count, nested_blocksize), generator=b.generator) * 2
    codes = b.bytes_(count)
    return [codes, absmax2, _sorted_code(b), nested_blocksize, torch.tensor(b.rng.choice((0.0, 0.25, -1.5)))]


def _gemv_blockwise(b: _Builder) -> list[Any]:
    rows, cols = b.rng.randint(1, 40), b.rng.choice((b.rng.randint(1, 70), 32, 64, 128))
    blocksize = b.rng.choice(_BLOCKSIZES_8BIT)
    tokens = b.rng.choice(((cols,), (1, cols), (3, cols), (2, 2, cols), (9, cols)))
    numel = rows * cols
    absmax = _absmax(b, numel, blocksize)
    nested = _nested_scales(b, absmax) if b.rng.random() < 0.3 else [absmax, None, None, 256, None]
    args = [
        b.floats(tokens, b.rng.choice(checks.FLOAT_DTYPES)),
        b.bytes_(numel).reshape(rows, cols),
        nested[0],
        _sorted_code(b),
        blocksize,
        *nested[1:],
    ]

    def absmax_ok(t: torch.Tensor) -> bool:
        count = checks.block_count(numel, args[4])
        if args[5] is None:
            return _absmax_ok(numel, args[4])(t)
        return t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == count

    names = ("A", "B", "absmax", "code", "blocksize") + (
        ("absmax2", "code2", "nested_blocksize", "offset") if args[5] is not None else ()
    )
    for what in b.which(names):
        if what == "A":
            b.tensor_mutation(
                args, 0, "A", lambda t: _floats_ok(t) and t.dim() >= 1 and t.shape[-1] == cols, primary=True
            )
        elif what == "B":
            b.tensor_mutation(
                args, 1, "B", lambda t: t.dtype == torch.uint8 and t.shape == (rows, cols) and t.is_contiguous()
            )
        elif what == "absmax":
            b.tensor_mutation(args, 2, "absmax", absmax_ok)
        elif what == "code":
            b.tensor_mutation(args, 3, "code", _code_ok)
        elif what == "blocksize":
            b.blocksize(args, 4, None, numel=numel)
        elif what == "absmax2":
            count = args[2].numel()
            b.tensor_mutation(
                args,
                5,
                "absmax2",
                lambda t, count=count: (
                    t.dtype == torch.float32 and t.dim() == 1 and t.numel() == checks.block_count(count, args[7])
                ),
            )
        elif what == "code2":
            b.tensor_mutation(args, 6, "code2", _code_ok)
        elif what == "nested_blocksize":
            value = b.rng.choice((0, -3, 1, 2, 255, 256, 1 << 40))
            valid = 1 <= value <= checks.MAX_BLOCKSIZE_8BIT and checks.block_count(
                args[2].numel(), value
            ) == checks.block_count(args[2].numel(), args[7])
            args[7] = value
            b.mutate(f"nested_blocksize {value}", valid)
        else:
            value = b.rng.choice((0.5, torch.tensor(0.5, dtype=torch.float64), torch.ones(2), torch.tensor([-2.0])))
            args[8] = value
            valid = isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.numel() == 1
            b.mutate(f"offset {value!r}", valid)
    return args


def _gemv_float8(b: _Builder) -> list[Any]:
    from tightfit.ops.float8_gemv import FLOAT8_FORMATS

    rows, cols = b.rng.randint(1, 40), b.rng.choice((b.rng.randint(1, 70), 16, 32, 64, 128))
    fmt = b.rng.choice(sorted(FLOAT8_FORMATS, key=str))
    dtype = b.rng.choice(checks.FLOAT_DTYPES)
    tokens = b.rng.choice(((cols,), (1, cols), (3, cols), (2, 2, cols), (8, cols), (9, cols), (0, cols)))
    if b.rng.random() < 0.1:  # every bit pattern: NaN and inf where the format has them
        weight = b.bytes_(rows * cols).reshape(rows, cols).view(fmt)
    else:
        weight = torch.randn(rows, cols, generator=b.generator).to(fmt)
    kind = b.rng.choice(("none", "tensor", "one", "row"))
    exponents = torch.randint(-6, 1, (rows, 1), generator=b.generator)
    scale = {
        "none": None,
        "tensor": torch.tensor(0.25),
        "one": torch.tensor([2.0]),
        "row": torch.ldexp(torch.ones(rows, 1), exponents),
    }[kind]
    if scale is not None:
        scale = scale.to(b.rng.choice(checks.FLOAT_DTYPES))
    bias = b.floats((rows,), dtype) if b.rng.random() < 0.5 else None
    args = [b.floats(tokens, dtype), weight, scale, bias]

    def scale_ok(t: torch.Tensor) -> bool:
        return t.dtype in checks.FLOAT_DTYPES and ((t.numel() == 1 and t.dim() <= 2) or tuple(t.shape) == (rows, 1))

    def bias_ok(t: torch.Tensor) -> bool:
        return isinstance(args[0], torch.Tensor) and t.dtype == args[0].dtype and tuple(t.shape) == (rows,)

    for what in b.which(("A", "weight", "scale", "bias")):
        if what == "A":
            b.tensor_mutation(
                args,
                0,
                "A",
                lambda t: (
                    _floats_ok(t)
                    and t.dim() >= 1
                    and t.shape[-1] == cols
                    and (args[3] is None or args[3].dtype == t.dtype)
                ),
                primary=True,
            )
        elif what == "weight":
            b.tensor_mutation(
                args,
                1,
                "weight",
                lambda t: t.dtype in FLOAT8_FORMATS and t.shape == (rows, cols) and t.is_contiguous(),
            )
        elif what == "scale" and scale is not None:
            b.tensor_mutation(args, 2, "scale", scale_ok, optional=True)
        elif what == "bias" and bias is not None:
            b.tensor_mutation(args, 3, "bias", bias_ok, optional=True)
    return args


def _int8_vectorwise_quant(b: _Builder) -> list[Any]:
    shape = b.rng.choice(
        ((b.rng.randint(0, 9), b.rng.randint(0, 40)), (b.rng.randint(1, 40),), (2, 3, b.rng.randint(0, 9)))
    )
    args = [b.floats(shape, b.rng.choice(checks.FLOAT_DTYPES)), b.rng.choice((0.0, 0.5, 2.0, 6.0))]
    for what in b.which(("A", "threshold")):
        if what == "A":
            b.tensor_mutation(args, 0, "A", lambda t: _floats_ok(t) and t.dim() >= 1, primary=True)
        else:
            args[1] = b.rng.choice((-1.0, math.nan, math.inf, 1e300))
            b.mutate(f"threshold {args[1]}", args[1] >= 0)
    return args


def _int8_linear_matmul(b: _Builder) -> list[Any]:
    rows, inner, out = b.rng.randint(0, 9), b.rng.choice((1, b.rng.randint(0, 40))), b.rng.randint(0, 9)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-127, 128, shape, generator=b.generator, dtype=torch.int8)

    args = [ints(rows, inner), ints(out, inner)]
    for what in b.which(("A", "B")):
        if what == "A":
            b.tensor_mutation(
                args, 0, "A", lambda t: t.dtype == torch.int8 and t.dim() >= 1 and t.shape[-1] == inner, primary=True
            )
        else:
            b.tensor_mutation(args, 1, "B", lambda t: t.dtype == torch.int8 and t.shape == (out, inner))
    return args


def _int8_mm_dequant(b: _Builder) -> list[Any]:
    rows, cols = b.rng.randint(0, 9), b.rng.randint(0, 20)
    product = torch.randint(-(1 << 20), 1 << 20, (rows, cols), generator=b.generator, dtype=torch.int32)
    bias = b.floats((cols,), torch.float32) if b.rng.random() < 0.5 else None
    args = [
        product,
        torch.rand(rows, generator=b.generator) * 5,
        torch.rand(cols, generator=b.generator) * 5,
        b.rng.choice(checks.FLOAT_DTYPES),
        bias,
    ]

    def stats_ok(count: int) -> Callable[[torch.Tensor], bool]:
        return lambda t: t.dtype == torch.float32 and t.numel() == count

    for what in b.which(("A", "row_stats", "col_stats", "dtype", "bias")):
        if what == "A":
            b.tensor_mutation(
                args,
                0,
                "A",
                lambda t: (
                    t.dtype == torch.int32 and t.dim() >= 1 and t.shape[-1] == cols and math.prod(t.shape[:-1]) == rows
                ),
                primary=True,
            )
        elif what == "row_stats":
            b.tensor_mutation(args, 1, "row_stats", stats_ok(rows))
        elif what == "col_stats":
            b.tensor_mutation(args, 2, "col_stats", stats_ok(cols))
        elif what == "dtype":
            b.choice_arg(args, 3, "dtype", _ANY_DTYPES, checks.FLOAT_DTYPES)
        elif bias is not None:
            b.tensor_mutation(
                args,
                4,
                "bias",
                lambda t: t.dtype in (*checks.FLOAT_DTYPES, torch.float64) and t.shape == (cols,),
                optional=True,
            )
    return args


def _int8_linear(b: _Builder) -> list[Any]:
    rows, inner, out = b.rng.randint(0, 6), b.rng.choice((1, b.rng.randint(1, 40))), b.rng.randint(1, 9)
    A = b.floats(b.rng.choice(((inner,), (rows, inner), (2, rows, inner))), b.rng.choice(checks.FLOAT_DTYPES))
    if not bool(torch.isfinite(A).all()):
        b.mutate("A not finite", False)  # LLM.int8() quantization refuses NaN and inf
    bias = torch.randn(out, generator=b.generator).to(b.rng.choice(checks.FLOAT_DTYPES))
    args = [
        A,
        torch.randint(-127, 128, (out, inner), generator=b.generator, dtype=torch.int8),
        torch.rand(out, generator=b.generator) * 5,
        bias if b.rng.random() < 0.5 else None,
        b.rng.choice((0.0, 0.5, 2.0, 6.0)),
    ]
    for what in b.which(("A", "weight", "SCB", "bias", "threshold")):
        if what == "A":
            b.tensor_mutation(
                args,
                0,
                "A",
                lambda t: _floats_ok(t) and t.dim() >= 1 and t.shape[-1] == inner and bool(torch.isfinite(t).all()),
                primary=True,
            )
        elif what == "weight":
            b.tensor_mutation(args, 1, "weight", lambda t: t.dtype == torch.int8 and t.shape == (out, inner))
        elif what == "SCB":
            b.tensor_mutation(args, 2, "SCB", lambda t: t.dtype == torch.float32 and t.shape == (out,))
        elif what == "bias":
            args[3] = bias
            b.tensor_mutation(args, 3, "bias", lambda t: _floats_ok(t) and t.shape == (out,), optional=True)
        else:
            args[4] = b.rng.choice((-1.0, math.nan, math.inf, 1e300))
            b.mutate(f"threshold {args[4]}", args[4] >= 0)
    return args


def _cast_dtypes() -> tuple[torch.dtype, ...]:
    from tightfit.ops.cast import CAST_DTYPES

    return tuple(sorted(CAST_DTYPES, key=str))


def _cast(b: _Builder) -> list[Any]:
    accepted = _cast_dtypes()
    args = [b.floats(b.shape(), b.rng.choice(accepted)), b.rng.choice(accepted)]
    for what in b.which(("x", "dtype")):
        if what == "x":
            b.tensor_mutation(args, 0, "x", lambda t: t.dtype in accepted, primary=True)
        else:
            b.choice_arg(args, 1, "dtype", _ANY_DTYPES, accepted)
    return args


def _cast_into(b: _Builder) -> list[Any]:
    accepted = _cast_dtypes()
    x = b.floats(b.shape(), b.rng.choice(accepted))
    args = [x, torch.empty(x.shape, dtype=b.rng.choice(accepted))]
    for what in b.which(("x", "out", "alias")):
        if what == "alias" and x.numel():
            args[1] = x.reshape(-1).view(torch.uint8)[: x.numel()].reshape(x.shape) if x.dtype.itemsize > 1 else x
            b.mutate("out aliases x", False)
        elif what == "x":
            b.tensor_mutation(args, 0, "x", lambda t: t.dtype in accepted and t.shape == x.shape, primary=True)
        elif what == "out":
            b.tensor_mutation(args, 1, "out", lambda t: t.dtype in accepted and t.shape == x.shape)
    return args


def _optimizer_update(b: _Builder, eight_bit: bool) -> list[Any]:
    """Arguments of one optimizer step in schema order: name, g, p, states (8-bit: codes,
    absmax and maps), then beta1, beta2, beta3, alpha, eps, weight_decay, step, lr."""
    name, shape = b.rng.choice(OPTIMIZERS), b.shape(max_rank=2)
    dtype = b.rng.choice(checks.FLOAT_DTYPES)
    numel, two = math.prod(shape), name in TWO_STATE_OPTIMIZERS
    first = (2, *shape) if name == "ademamix" else shape
    blocks = checks.block_count(numel, OPTIMIZER_BLOCKSIZE)
    g, p = b.floats(shape, dtype), b.floats(shape, dtype)
    if eight_bit:
        state1 = b.bytes_(math.prod(first)).reshape(first)
        absmax1 = torch.rand((2, blocks) if name == "ademamix" else (blocks,), generator=b.generator) * 0.1
        second = [b.bytes_(numel).reshape(shape), torch.rand(blocks, generator=b.generator) * 1e-3, dynamic_map(False)]
        states = [state1, second[0] if two else None, absmax1, second[1] if two else None, dynamic_map()]
        states.append(second[2] if two else None)
    else:
        states = [
            b.floats(first, torch.float32) * 0.01,
            (torch.rand(shape, generator=b.generator) * 1e-3) if two else None,
        ]
    scalars = [0.9, 0.999, 0.9999 if name == "ademamix" else 0.0, 5.0 if name == "ademamix" else 0.0, 1e-8]
    scalars += [b.rng.choice((0.0, 0.01)), b.rng.randint(1, 10), 1e-3]
    args = [name, g, p, *states, *scalars]
    same = lambda t: t.dtype == p.dtype and t.shape == p.shape  # noqa: E731
    state_dtype = torch.uint8 if eight_bit else torch.float32
    first_ok = lambda t: t.dtype == state_dtype and tuple(t.shape) == first and t.is_contiguous()  # noqa: E731
    at = len(args) - 8  # where the scalars start
    for what in b.which(
        ("g", "p", "state1", "state2", "name", "beta1", "step", "lr") + (("qmap1",) if eight_bit else ())
    ):
        if what == "g":
            b.tensor_mutation(args, 1, "g", same, primary=True)
        elif what == "p":
            b.tensor_mutation(args, 2, "p", lambda t: same(t) and t.is_contiguous(), primary=True)
        elif what == "state1":
            b.tensor_mutation(args, 3, "state1", first_ok)
        elif what == "state2" and args[4] is not None:
            b.tensor_mutation(
                args, 4, "state2", lambda t: t.dtype == state_dtype and t.shape == p.shape and t.is_contiguous()
            )
        elif what == "state2":
            args[4] = torch.zeros(shape, dtype=state_dtype)
            b.mutate("state2 given to a one-state rule", False)
        elif what == "qmap1":
            args[7] = args[7][torch.randperm(256, generator=b.generator)]
            b.mutate("qmap1 shuffled", False)
        elif what == "name":
            b.choice_arg(args, 0, "optimizer_name", ("adamw", "", name), (name,))
        elif what == "beta1":
            b.choice_arg(args, at, "beta1", (1.0, -0.1, math.nan, 0.5), (0.5,))
        elif what == "step":
            b.choice_arg(args, at + 6, "step", (0, -1, 1.5, 3), (3,))
        else:
            b.choice_arg(args, at + 7, "lr", (-1e-3, math.inf, "0.1", 0.0), (0.0,))
    return args


_GENERATORS: dict[str, Callable[[_Builder], list[Any]]] = {
    "quantize_blockwise": _quantize_blockwise,
    "dequantize_blockwise": _dequantize_blockwise,
    "quantize_4bit": _quantize_4bit,
    "dequantize_4bit": _dequantize_4bit,
    "gemv_4bit": _gemv_4bit,
    "gemv_4bit_int8": _gemv_4bit,  # the same arguments
    "gemv_blockwise": _gemv_blockwise,
    "gemv_blockwise_int8": _gemv_blockwise,  # the same arguments
    "gemv_float8": _gemv_float8,
    "int8_vectorwise_quant": _int8_vectorwise_quant,
    "int8_linear_matmul": _int8_linear_matmul,
    "int8_mm_dequant": _int8_mm_dequant,
    "int8_linear": _int8_linear,
    "cast": _cast,
    "cast_into": _cast_into,
    "optimizer_update_32bit": lambda b: _optimizer_update(b, eight_bit=False),
    "optimizer_update_8bit_blockwise": lambda b: _optimizer_update(b, eight_bit=True),
}


#: Ops that run the CPU int8 matmul, whose every path (pinned per case) must be exact.
_INT8_MATMUL_OPS = ("int8_linear_matmul", "int8_linear")


def make_case(seed: int, index: int) -> FuzzCase:
    """Case ``index`` of campaign ``seed``: the same arguments every time, in any process."""
    rng = random.Random(f"{seed}:{index}")
    op = rng.choice(sorted(_GENERATORS))
    builder = _Builder(rng)
    args = _GENERATORS[op](builder)
    int8_path = rng.choice(("auto", *_cpu_int8.PATHS)) if op in _INT8_MATMUL_OPS else "auto"
    label = ", ".join(builder.labels) or "valid"
    return FuzzCase(op, args, builder.valid, label if int8_path == "auto" else f"{label} (path {int8_path})", int8_path)


def _snapshot(args: list[Any]) -> list[Any]:
    return [arg.clone() if isinstance(arg, torch.Tensor) and arg.device.type != "meta" else arg for arg in args]


def _unchanged(before: list[Any], after: list[Any], skip: tuple[int, ...]) -> bool:
    from tightfit.ops.conformance import _bytes_differing

    return all(
        i in skip or not isinstance(a, torch.Tensor) or a.device.type == "meta" or _bytes_differing(a, b) == 0
        for i, (a, b) in enumerate(zip(before, after))
    )


@contextlib.contextmanager
def _int8_path_pinned(path: str) -> Iterator[None]:
    before = os.environ.get(_cpu_int8.PATH_VARIABLE)
    os.environ[_cpu_int8.PATH_VARIABLE] = path
    try:
        yield
    finally:
        if before is None:
            del os.environ[_cpu_int8.PATH_VARIABLE]
        else:
            os.environ[_cpu_int8.PATH_VARIABLE] = before


def run_case(case: FuzzCase, index: int) -> tuple[str, str]:
    """(outcome, detail) of one case, run in this process; even indices take the direct path."""
    from tightfit.ops.conformance import _compare

    opdef = get_op(case.op)
    before = _snapshot(case.args)
    call = opdef if index % 2 == 0 else getattr(torch.ops.tightfit, case.op)
    try:
        with _int8_path_pinned(case.int8_path):
            result = call(*case.args)
    except CLEAN_ERRORS as error:
        return ("clean" if not case.valid else "refused"), f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    except Exception as error:
        return "unclean", f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    if not case.valid:
        return "wrong", "returned a result for invalid arguments"
    if not _unchanged(before, case.args, opdef.mutated):
        return "wrong", "modified an input it only reads"
    expected_args = _snapshot(before)
    expected = opdef.reference(*expected_args)
    if opdef.mutated:
        expected, result = [expected_args[i] for i in opdef.mutated], [case.args[i] for i in opdef.mutated]
    problem = _compare(*_finite_parts(expected, result, opdef.metric), opdef.metric)
    return ("wrong", problem) if problem else ("equal", "")


def _finite_parts(expected: Any, actual: Any, metric: str | float) -> tuple[Any, Any]:
    """For a tolerance metric, where non-finite values sit must match and the rest is compared:
    a reassociated sum over inf and -inf may give NaN where the reference gives inf."""
    if (
        metric == "bitwise"
        or not isinstance(expected, torch.Tensor)
        or not isinstance(actual, torch.Tensor)
        or expected.shape != actual.shape
        or bool(torch.isfinite(expected).all())
    ):
        return expected, actual
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(actual)):
        return expected, actual  # _compare reports the difference
    return expected[finite], actual[finite]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], target="tightfit.ops.fuzz"))
