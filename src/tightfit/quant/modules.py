"""Quantized ``nn.Linear`` replacements for inference: weights stay compact on their
device and are decoded per call into the activation's dtype.

State dicts use the bitsandbytes / transformers layout (``weight`` plus
``weight.absmax``, ``weight.quant_map``, ... and the packed ``quant_state`` entry), so
a checkpoint saved by one loads in the other. Loading checks a layer's entries together
and applies all of them or none: a new weight never meets stale scales.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tightfit import ops
from tightfit._validate import check_choice, check_non_negative_number, check_type
from tightfit.ops import _arg_checks as op_checks
from tightfit.ops import _cpu_int8, _cpu_int8_rows
from tightfit.ops._arg_checks import FLOAT_DTYPES, block_count
from tightfit.ops._autograd import _check_int8_linear as check_int8_linear
from tightfit.ops._cpu_gemv import bind_gemv_4bit_int8, bind_gemv_8bit_int8, bind_gemv_blockwise
from tightfit.ops._direct import DIRECT_DEVICE_TYPES, binding_of, direct_rows, passes_op_check, with_bias
from tightfit.ops.blockwise_gemv import _gemv_4bit_gpu, _gemv_blockwise_gpu
from tightfit.ops.blockwise_gemv_int8 import int8_table, int16_table
from tightfit.ops.codes import code_4bit
from tightfit.quant import _checkpoint as checks
from tightfit.quant import _tiled
from tightfit.quant import functional as F
from tightfit.quant.state import QuantState

__all__ = ["Linear4bit", "Linear8bit", "LinearInt8", "QuantizedLinear", "move_unregistered", "unregistered_tensors"]


def _frozen_copy(bias: torch.Tensor | None) -> nn.Parameter | None:
    return nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None


def _check_input(x: torch.Tensor, in_features: int) -> None:
    check_type("x", x, torch.Tensor)
    if x.dtype not in FLOAT_DTYPES:  # as nn.Linear refuses them; decoding into an integer dtype would truncate
        raise TypeError(f"x has dtype {x.dtype}; accepted: float32, float16, bfloat16")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(
            f"input has {x.shape[-1] if x.dim() else 0} features in its last dimension; this layer takes {in_features}"
        )


class _CheckedLoading(nn.Module, abc.ABC):
    """``load_state_dict`` for a layer whose entries only make sense together (D9): they
    are taken out of the state dict, all checked, then all applied. When some are absent
    they are reported in ``missing_keys`` (so ``strict=True`` fails, as torch reports
    missing keys) and the layer keeps what it had; a bad entry raises ValueError or
    TypeError with the layer unchanged."""

    @abc.abstractmethod
    def _owns(self, name: str) -> bool:
        """Whether the entry ``name`` (without prefix) is this layer's to read."""

    @abc.abstractmethod
    def _required(self, names: Iterable[str]) -> list[str]:
        """The entries a complete checkpoint of this layer has, given those present."""

    @abc.abstractmethod
    def _read_entries(self, entries: dict[str, Any], prefix: str, device: torch.device) -> dict[str, Any]:
        """The checked attributes to set, on ``device``, from the entries other than the bias."""

    #: Buffers whose dtype is part of the stored format (packed codes, int8 values, scales).
    _format_buffers: tuple[str, ...] = ("weight",)

    def _apply(self, fn: Any, recurse: bool = True) -> _CheckedLoading:
        """``.half()``, ``.to(dtype)``, ... cast the bias only: the format's buffers move
        with the module but keep their dtype (a float16 scale or a packed weight reinterpreted
        as a float cast would no longer decode)."""
        kept = {name: getattr(self, name) for name in self._format_buffers}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        entries = {
            key[len(prefix) :]: state_dict.pop(key)
            for key in list(state_dict)
            if isinstance(key, str) and key.startswith(prefix) and self._owns(key[len(prefix) :])
        }
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        taken = {prefix + name for name in entries}
        missing_keys[:] = [key for key in missing_keys if key not in taken]  # torch saw them popped, not absent
        absent = [prefix + name for name in self._required(entries) if name not in entries]
        if absent:
            missing_keys.extend([key for key in absent if key not in missing_keys])
            return
        assign = local_metadata.get(
            "assign_to_params_buffers", False
        )  # load_state_dict(assign=True): keep their device
        device = (
            entries["weight"].device if assign and isinstance(entries["weight"], torch.Tensor) else self.weight.device
        )
        values = self._read_entries(entries, prefix, device)
        bias = checks.bias(prefix + "bias", entries["bias"], self.bias) if self.bias is not None else None
        for name, value in values.items():
            setattr(self, name, value)
        if bias is not None and assign:
            self.bias = nn.Parameter(bias, requires_grad=False)
        elif bias is not None:
            with torch.no_grad():
                self.bias.copy_(bias)


class QuantizedLinear(_CheckedLoading):
    """Shared machinery: a packed weight buffer, its QuantState, an optional bias.

    ``compute`` (an attribute, not saved with the weights): ``"float"``, or ``"int8"`` to
    quantize the activations to int8 per block of 32 and multiply in integers (faster on
    CPUs, less exact: :func:`tightfit.ops.gemv_4bit_int8`, :func:`tightfit.ops.gemv_blockwise_int8`)."""

    compute: str = "float"

    def __init__(
        self, in_features: int, out_features: int, packed: torch.Tensor, state: QuantState, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", packed)
        self.quant_state = state
        self.bias = _frozen_copy(bias)

    @abc.abstractmethod
    def _decode(self) -> torch.Tensor:
        """The weight decoded from ``self.weight`` and ``self.quant_state``."""

    def dequantize(self) -> torch.Tensor:
        """The full-precision weight (``out_features x in_features``) in the original dtype."""
        return self._decode().reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.in_features)
        direct = self._direct(x)
        return direct if direct is not None else self._through_op(x)

    @abc.abstractmethod
    def _through_op(self, x: torch.Tensor) -> torch.Tensor:
        """The forward through the ops (with their checks, dispatch and autograd)."""

    def _direct(self, x: torch.Tensor) -> torch.Tensor | None:
        """The few-token forward through the kernel bound to this layer's weight, past the
        dispatcher (:mod:`tightfit.ops._direct`), or None where the op must run."""
        rows = direct_rows(x, self.in_features, self.bias, DIRECT_DEVICE_TYPES)
        if rows is None:
            return None
        state = self.quant_state
        absmax, *nested = F._stored_scales(state)
        held = [self.weight, *[tensor for tensor in (absmax, state.code, *nested) if isinstance(tensor, torch.Tensor)]]
        device = x.device  # in the settings: a CPU binding never reads a GPU's tensors, nor the reverse
        settings = (device, self.compute, state.quant_type, state.blocksize, state.shape, nested[2])
        kernel = binding_of(self).kernel(
            held, settings, lambda: self._bind_checked(absmax, tuple(nested), held, device)
        )
        if kernel is None:
            return None
        return with_bias(kernel(rows), self.bias, x.dtype).view(*x.shape[:-1], self.out_features)

    def _bind_checked(self, absmax: torch.Tensor, nested: tuple, held: list[torch.Tensor], device: torch.device):
        """:meth:`_bind` (or, on a CUDA device, :meth:`_bind_gpu`) after the op's own check of
        this layer's tensors, all plain and on ``device``; else None: the op runs, and raises
        its error (a weight of the wrong size, on meta or another device, a fake tensor)."""
        if not passes_op_check(held, lambda: self._check_op_arguments(absmax, nested), device):
            return None
        return self._bind(absmax, nested, held) if device.type == "cpu" else self._bind_gpu()

    def _bind_gpu(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The op's own GPU kernel over this layer's tensors as they are at each call, held
        through a weak reference to the layer (an offloading hook still frees the weight);
        None for int8 compute, which has no GPU kernel (the op runs, and says so)."""
        if self.compute != "float":
            return None
        layer = weakref.ref(self)
        return lambda rows: layer()._gpu_kernel(rows)

    @abc.abstractmethod
    def _gpu_kernel(self, rows: torch.Tensor) -> torch.Tensor:
        """The few-token product of ``rows`` with this layer's weight by the op's GPU kernel."""

    @abc.abstractmethod
    def _check_op_arguments(self, absmax: torch.Tensor, nested: tuple) -> None:
        """The op's check (D9) of the arguments this layer's forward passes it, for one row."""

    @abc.abstractmethod
    def _bind(self, absmax: torch.Tensor, nested: tuple, held: list[torch.Tensor]):
        """The few-token kernel bound to this layer's weight (None: no native build)."""

    #: The blocksize :meth:`transient_bytes` assumes unless told (the format's default config).
    default_blocksize: int = 64

    @classmethod
    def _nested_blocksize(cls, blocksize: int) -> int:
        """Blocks of scales per block of a double-quantized absmax."""
        return blocksize

    @classmethod
    def transient_bytes(
        cls,
        shape: tuple[int, ...],
        rows: int,
        outliers: int,
        dtype: torch.dtype,
        *,
        blocksize: int | None = None,
        nested: bool = False,
    ) -> int:
        """Bytes :meth:`forward` holds above its output for ``rows`` rows (tokens) of a
        weight of ``shape`` stored in ``dtype`` (or in float32) and run in ``dtype``:
        one tile of decoded weight rows (about ``_tiled.TILE_BYTES``; the whole weight
        when it is smaller), and for a ``nested`` absmax the float32 scales of the tile,
        decoded from the nested blocks that hold them, at the largest tile. The weight is
        in blocks of ``blocksize`` (default :attr:`default_blocksize`). Nothing for no
        rows; up to ``FEW_TOKENS`` rows without gradients the few-token kernels run, which
        decode nothing (they hold the input and the output in float32), and are counted
        as if they decoded a tile: an upper bound. Tensors between ops, as
        :class:`tightfit.memory.LiveTensorBytes` counts them (tests/quant/test_tiled_linear.py
        holds the forward to it)."""
        if rows == 0:
            return 0
        blocksize = cls.default_blocksize if blocksize is None else blocksize
        nested_blocksize = cls._nested_blocksize(blocksize) if nested else 0
        return _tiled.transient_bytes(tuple(shape), dtype.itemsize, blocksize, nested_blocksize)

    def unregistered_tensors(self) -> list[torch.Tensor]:
        """The tensors this layer holds outside its parameters and buffers (its
        QuantState's scales and maps): memory accounting adds them, and offloading, which
        moves parameters and buffers, leaves them where they are."""
        return self.quant_state.tensors()

    def move_unregistered(self, device: torch.device | str) -> None:
        """Move :meth:`unregistered_tensors` to ``device`` (where the forward decodes)."""
        self.quant_state = self.quant_state.to(device)

    def _apply(self, fn: Any, recurse: bool = True) -> QuantizedLinear:
        super()._apply(fn, recurse)
        self.move_unregistered(self.weight.device)  # the QuantState keeps its dtypes too
        return self

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, value in self.quant_state.as_dict(packed=True).items():
            destination[f"{prefix}weight.{key}"] = value if keep_vars else value.detach()

    def _owns(self, name: str) -> bool:
        return name == "weight" or name.startswith("weight.") or (name == "bias" and self.bias is not None)

    def _required(self, names: Iterable[str]) -> list[str]:
        required = ["weight"] + (["bias"] if self.bias is not None else [])
        if not any(name.startswith("weight.") for name in names):  # none given: name those this layer has
            required += [f"weight.{key}" for key in self.quant_state.as_dict(packed=True)]
        return required

    @abc.abstractmethod
    def _checked_weight(self, name: str, weight: object, state: QuantState) -> torch.Tensor:
        """``weight`` from a checkpoint, checked against this layer and ``state``."""

    def _read_entries(self, entries: dict[str, Any], prefix: str, device: torch.device) -> dict[str, Any]:
        state = QuantState.from_dict(
            {prefix + name: value for name, value in entries.items() if name.startswith("weight.")}, device=device
        )
        weight = self._checked_weight(prefix + "weight", entries["weight"], state)
        return {"weight": weight.to(device), "quant_state": state}

    def extra_repr(self) -> str:
        state = self.quant_state
        kind = state.quant_type or "8-bit blockwise"
        compute = f", compute={self.compute}" if self.compute != "float" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, blocksize={state.blocksize}, nested={state.nested}, bias={self.bias is not None}{compute}"


def _check_linear(linear: object) -> nn.Linear:
    check_type("linear", linear, nn.Linear)
    if linear.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"linear.weight has dtype {linear.weight.dtype}; accepted: float32, float16, bfloat16")
    return linear


class Linear4bit(QuantizedLinear):
    """``nn.Linear`` with an NF4 or FP4 weight (4 bits per value plus one scale per block)."""

    default_blocksize = 64

    @classmethod
    def _nested_blocksize(cls, blocksize: int) -> int:
        return F.NESTED_BLOCKSIZE_4BIT

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        quant_type: str = "nf4",
        blocksize: int = 64,
        compress_statistics: bool = False,
        quant_storage: torch.dtype = torch.uint8,
        compute: str = "float",
    ) -> Linear4bit:
        _check_linear(linear)
        check_choice("compute", compute, F.COMPUTE_CHOICES)
        packed, state = F.quantize_4bit(
            linear.weight.detach(),
            blocksize=blocksize,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            quant_storage=quant_storage,
        )
        layer = cls(linear.in_features, linear.out_features, packed, state, linear.bias)
        layer.compute = compute
        return layer

    def _decode(self) -> torch.Tensor:
        return F.dequantize_4bit(self.weight, self.quant_state)

    def _checked_weight(self, name: str, weight: object, state: QuantState) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        if state.quant_type is None or state.shape != shape:
            raise ValueError(
                f"{name}'s quant state is {state.quant_type or '8-bit blockwise'} of shape {state.shape}; "
                f"accepted: nf4 or fp4 of shape {shape}"
            )
        return checks.packed_4bit(name, weight, shape)

    def _through_op(self, x: torch.Tensor) -> torch.Tensor:
        return F.matmul_4bit(x, self.weight, self.quant_state, bias=self.bias, compute=self.compute)

    def _gpu_kernel(self, rows: torch.Tensor) -> torch.Tensor:
        state = self.quant_state
        absmax, *nested = F._stored_scales(state)
        return _gemv_4bit_gpu(rows, self.weight, state.shape, absmax, state.blocksize, state.quant_type, *nested)

    def _check_op_arguments(self, absmax: torch.Tensor, nested: tuple) -> None:
        state = self.quant_state
        one_row = torch.empty(1, self.in_features, device=self.weight.device)  # the op checks devices agree
        op_checks.gemv_4bit(one_row, self.weight, list(state.shape), absmax, state.blocksize, state.quant_type, *nested)
        if tuple(state.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quant_state.shape {tuple(state.shape)} is not the layer's")

    def _bind(self, absmax: torch.Tensor, nested: tuple, held: list[torch.Tensor]):
        state = self.quant_state
        if self.compute == "int8":
            table8 = int8_table(state.quant_type)
            return bind_gemv_4bit_int8(self.weight, state.shape, absmax, table8, state.blocksize, nested, held)
        table = code_4bit(state.quant_type)
        return bind_gemv_blockwise(
            self.weight, 4, state.shape, absmax, table, state.blocksize, "gemv_4bit", nested, held
        )


class Linear8bit(QuantizedLinear):
    """``nn.Linear`` with a blockwise 8-bit weight (dynamic map, one scale per block)."""

    default_blocksize = 4096

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, blocksize: int = 4096, nested: bool = False, compute: str = "float"
    ) -> Linear8bit:
        _check_linear(linear)
        check_choice("compute", compute, F.COMPUTE_CHOICES)
        q, state = F.quantize_blockwise(linear.weight.detach(), blocksize=blocksize, nested=nested)
        layer = cls(linear.in_features, linear.out_features, q, state, linear.bias)
        layer.compute = compute
        return layer

    def _through_op(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute == "float":
            return F._decoded_linear(x, self.weight, self.quant_state, self.bias)
        state = self.quant_state
        absmax, *nested = F._stored_scales(state)
        return with_bias(
            ops.gemv_blockwise_int8(x, self.weight, absmax, state.code, state.blocksize, *nested), self.bias, x.dtype
        )

    def _gpu_kernel(self, rows: torch.Tensor) -> torch.Tensor:
        state = self.quant_state
        absmax, *nested = F._stored_scales(state)
        return _gemv_blockwise_gpu(rows, self.weight, absmax, state.code, state.blocksize, *nested)

    def _check_op_arguments(self, absmax: torch.Tensor, nested: tuple) -> None:
        state = self.quant_state
        one_row = torch.empty(1, self.in_features, device=self.weight.device)  # the op checks devices agree
        op_checks.gemv_blockwise(one_row, self.weight, absmax, state.code, state.blocksize, *nested)
        if tuple(self.weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(self.weight.shape)} is not the layer's")

    def _bind(self, absmax: torch.Tensor, nested: tuple, held: list[torch.Tensor]):
        state = self.quant_state
        shape = (self.out_features, self.in_features)
        if self.compute == "int8":
            table16, unit = int16_table(state.code)
            return bind_gemv_8bit_int8(self.weight, shape, absmax, table16, unit, state.blocksize, nested, held)
        return bind_gemv_blockwise(
            self.weight, 8, shape, absmax, state.code, state.blocksize, "gemv_blockwise", nested, held
        )

    def _decode(self) -> torch.Tensor:
        return F.dequantize_blockwise(self.weight, self.quant_state)

    def _checked_weight(self, name: str, weight: object, state: QuantState) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        if state.quant_type is not None or state.shape not in (None, shape):
            raise ValueError(
                f"{name}'s quant state is {state.quant_type or '8-bit blockwise'} of shape {state.shape}; "
                f"accepted: 8-bit blockwise of shape {shape}"
            )
        blocks = block_count(self.out_features * self.in_features, state.blocksize)
        if state.absmax.numel() != blocks:
            raise ValueError(
                f"{name}.absmax has {state.absmax.numel()} values; {shape} in blocks of {state.blocksize} needs {blocks}"
            )
        return checks.exact_tensor(name, weight, torch.uint8, shape)


class LinearInt8(_CheckedLoading):
    """LLM.int8(): int8 weights with one scale per output row; activations are quantized
    per row at run time and multiplied in int8, except columns holding an activation of
    magnitude >= ``threshold``, which are multiplied in the activation's dtype.

    The state dict holds ``weight`` (int8), ``SCB`` (the float32 row scales) and
    ``weight_format`` (0: row-major), the entries bitsandbytes' ``Linear8bitLt`` writes, so
    checkpoints load both ways with ``strict=True``.
    """

    _format_buffers = ("weight", "SCB")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        threshold: float,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.threshold = threshold
        self.register_buffer("weight", weight)
        self.register_buffer("SCB", scales)
        self.bias = _frozen_copy(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, threshold: float = 6.0) -> LinearInt8:
        _check_linear(linear)
        threshold = check_non_negative_number("threshold", threshold)
        weight, scales, _ = ops.int8_vectorwise_quant(linear.weight.detach())
        return cls(linear.in_features, linear.out_features, weight, scales, linear.bias, threshold)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32."""
        return ops.int8_vectorwise_dequant(self.weight, self.SCB)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight_format"] = torch.tensor(0, dtype=torch.uint8)

    def _owns(self, name: str) -> bool:
        return name in ("weight", "SCB", "weight_format") or (name == "bias" and self.bias is not None)

    def _required(self, names: Iterable[str]) -> list[str]:
        return ["weight", "SCB"] + (["bias"] if self.bias is not None else [])

    def _read_entries(self, entries: dict[str, Any], prefix: str, device: torch.device) -> dict[str, Any]:
        weight = checks.exact_tensor(
            prefix + "weight", entries["weight"], torch.int8, (self.out_features, self.in_features)
        )
        scales = checks.scales(prefix + "SCB", entries["SCB"], self.out_features)
        if "weight_format" in entries:
            checks.weight_format(prefix + "weight_format", entries["weight_format"])
        return {"weight": weight.to(device), "SCB": scales.to(device)}

    @classmethod
    def transient_bytes(cls, shape: tuple[int, ...], rows: int, outliers: int, dtype: torch.dtype) -> int:
        """Bytes :meth:`forward` (with a threshold) allocates for ``rows`` rows of a weight
        of ``shape`` above what it holds at its end (its output, in ``dtype``, which the
        int8 product replaces), at the largest of its peaks. The kernels are the CPU ones;
        their buffers inside one op are counted too, though no per-op count of live tensors
        sees them.

        1. ``int8_vectorwise_quant``: with numba, the codes, row scales, outlier indices and
           the kernel's flags (``_cpu_int8_rows.vectorwise_peak_bytes``); without, the
           reference's: the input with outliers masked, the outlier mask, the outlier
           indices, the row scales and their reciprocals, and scaling and rounding in
           float32 (the input cast to float32 first where it is not).
        2. ``int8_linear_matmul``, with the int8 input, row scales, outlier indices and int32
           product alive: its float scratch (``_cpu_int8.scratch_bytes``; none for few rows).
        3. ``int8_mm_dequant``, with the same alive: with numba nothing but the output;
           without, the float32 outer product of the scales, the product cast to float32
           and the scaled result.
        4. Only with ``outliers`` input columns, with the same alive and the output: the
           larger of dequantizing those columns' weights (the int8 columns, them as float32,
           the scales / 127, the scaled columns) or adding them back (the columns in the
           activation dtype, the input's columns, a second output).
        """
        out_features, in_features = shape
        itemsize = dtype.itemsize
        output = itemsize * rows * out_features
        held = rows * in_features + 4 * rows + 4 * rows * out_features + 8 * outliers
        quantize = _cpu_int8_rows.vectorwise_peak_bytes(rows, in_features, outliers)
        if quantize is None:  # the reference kernels
            quantize = (itemsize + 9) * rows * in_features + 8 * rows + 8 * outliers
            dequantize = 12 * rows * out_features - output
        else:
            dequantize = 0
        if outliers:
            weights = 9 * out_features * outliers + 4 * out_features
            add_back = itemsize * (out_features * outliers + rows * outliers) + output
            dequantize = max(dequantize, weights, add_back)
        matmul = _cpu_int8.scratch_bytes(rows, out_features, in_features) - output
        return max(quantize - output, held + matmul, held + dequantize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.in_features)
        rows = direct_rows(x, self.in_features, self.bias)
        if rows is not None and self._direct_allowed():  # past the dispatcher (tightfit.ops._direct)
            direct = _cpu_int8_rows.linear_rows(rows, self.weight, self.SCB, self.bias, self.threshold, x.dtype)
            if direct is not None:  # None: an outlier column, which the op's steps take
                return direct.view(*x.shape[:-1], self.out_features)
        return ops.int8_linear(x, self.weight, self.SCB, self.bias, self.threshold)

    def _direct_allowed(self) -> bool:
        """Whether the one native call may read this layer's tensors: plain, in CPU memory,
        and passing the op's own check (made once per set of tensors, :mod:`tightfit.ops._direct`)."""
        tensors = [self.weight, self.SCB, *([self.bias] if self.bias is not None else [])]

        def check() -> None:
            check_int8_linear(torch.empty(1, self.in_features), self.weight, self.SCB, self.bias, self.threshold)

        return bool(binding_of(self).kernel(tensors, (self.threshold,), lambda: passes_op_check(tensors, check)))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, threshold={self.threshold}, bias={self.bias is not None}"


def unregistered_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the layers under ``model`` hold outside their parameters and buffers
    (see :meth:`QuantizedLinear.unregistered_tensors`)."""
    check_type("model", model, nn.Module)
    return [
        tensor
        for module in model.modules()
        if isinstance(module, QuantizedLinear)
        for tensor in module.unregistered_tensors()
    ]


def move_unregistered(module: nn.Module, device: torch.device | str) -> None:
    """Move the tensors ``module`` itself (not its children) holds outside its parameters
    and buffers to ``device``; a no-op for a module that holds none."""
    check_type("module", module, nn.Module)
    if isinstance(module, QuantizedLinear):
        module.move_unregistered(device)
