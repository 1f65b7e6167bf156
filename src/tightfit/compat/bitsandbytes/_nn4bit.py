"""The 4-bit half of ``bitsandbytes.nn`` on tightfit's kernels: ``Params4bit`` and the
layers built on it, with bitsandbytes 0.50's constructor arguments, defaults and attributes.

A layer holds a float weight until ``.to(device)`` / ``.cpu()`` / ``.cuda()`` quantizes it
(``Params4bit.bnb_quantized``), or it is filled with packed codes read from a checkpoint
(``Params4bit.from_prequantized``, or ``load_state_dict`` with bitsandbytes' keys).
Quantizing and the forward go through :mod:`tightfit.quant.functional`, so they follow the
tensor's device (D1). Where this differs from bitsandbytes it is said at the name.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from tightfit._validate import check_choice, check_device, check_type
from tightfit.ops._arg_checks import BLOCKSIZES_4BIT, FLOAT_DTYPES, PACKED_DTYPES, check_blocksize, check_quant_type
from tightfit.quant import _checkpoint as checks
from tightfit.quant import functional as F
from tightfit.quant.state import QuantState

__all__ = [
    "Embedding4bit",
    "EmbeddingFP4",
    "EmbeddingNF4",
    "Linear4bit",
    "LinearFP4",
    "LinearNF4",
    "Params4bit",
    "fix_4bit_weight_quant_state_from_module",
]

logger = logging.getLogger(__name__)

_FLOAT_CASTS = (torch.Tensor.half, torch.Tensor.float, torch.Tensor.bfloat16, torch.Tensor.double)
#: What a Params4bit carries besides its data, in bitsandbytes' order (its ``__dict__``).
_FIELDS = ("blocksize", "compress_statistics", "quant_type", "quant_state", "quant_storage", "bnb_quantized", "module")


def _check_format(blocksize: object, compress_statistics: object, quant_type: object, quant_storage: object) -> None:
    check_blocksize(blocksize, BLOCKSIZES_4BIT)
    if compress_statistics is not None:  # bitsandbytes' embeddings pass None for "no"
        check_type("compress_statistics", compress_statistics, bool)
    check_quant_type(quant_type)
    check_type("quant_storage", quant_storage, torch.dtype)
    check_choice("quant_storage", quant_storage, PACKED_DTYPES)


def _check_optional_float_dtype(name: str, dtype: object) -> None:
    if dtype is not None:
        check_type(name, dtype, torch.dtype)
        check_choice(name, dtype, FLOAT_DTYPES)


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be int, got {type(value).__name__}: {value!r:.80}")
    if value < 1:
        raise ValueError(f"{name}={value} is not accepted; accepted: an int >= 1")
    return value


def _check_indices(input: object, count: int) -> None:
    """Integer indices below ``count``: an index out of range is an error here, not a
    device-side assert in the lookup (which leaves a GPU context unusable)."""
    check_type("input", input, torch.Tensor)
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input has dtype {input.dtype}; accepted: torch.int64, torch.int32 (indices)")
    if input.numel():
        low, high = (int(value) for value in torch.aminmax(input))
        if low < 0 or high >= count:
            raise ValueError(f"input holds index {low if low < 0 else high}; accepted: 0 to {count - 1}")


def _state_field(name: str, read: Any, nested_only: bool = False) -> property:
    """A read-only view of the QuantState's ``name`` (bitsandbytes has them so that FSDP
    finds the state dict's ``weight.absmax``, ... by ``getattr`` on the weight)."""

    def get(self: Params4bit) -> Any:
        state = self.__dict__.get("quant_state")
        if state is not None and (state.nested or not nested_only):
            return read(state)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    return property(get, doc=f"The quant state's {name}.")


def _rebuild_params4bit(state: dict[str, Any]) -> Params4bit:
    """Unpickling: a Params4bit again (``torch.nn.Parameter``'s own reduction would give a plain Parameter)."""
    param = Params4bit()
    param.__setstate__(state)
    return param


class Params4bit(nn.Parameter):
    """A weight that is float until moved to a device, packed 4-bit codes after.

    Unknown keyword arguments are ignored, as bitsandbytes does: transformers rebuilds a
    parameter with ``Params4bit(value, **old.__dict__)``.
    """

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = False,  # quantized weights are frozen
        quant_state: QuantState | None = None,
        blocksize: int | None = None,
        compress_statistics: bool | None = True,
        quant_type: str = "fp4",
        quant_storage: torch.dtype = torch.uint8,
        module: nn.Module | None = None,
        bnb_quantized: bool = False,
        **kwargs: Any,
    ) -> Params4bit:
        data = torch.empty(0) if data is None else data
        check_type("data", data, torch.Tensor)
        blocksize = 64 if blocksize is None else blocksize
        _check_format(blocksize, compress_statistics, quant_type, quant_storage)
        check_type("requires_grad", requires_grad, bool)
        check_type("bnb_quantized", bnb_quantized, bool)
        if quant_state is not None:
            check_type("quant_state", quant_state, QuantState)
        if module is not None:
            check_type("module", module, nn.Module)
        if requires_grad and not data.is_floating_point():
            raise ValueError(f"requires_grad=True is not accepted for data of dtype {data.dtype} (packed codes)")
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.blocksize = blocksize
        self.compress_statistics = compress_statistics
        self.quant_type = quant_type
        self.quant_state = quant_state
        self.quant_storage = quant_storage
        self.bnb_quantized = bnb_quantized
        self.module = module
        return self

    absmax = _state_field("absmax", lambda state: state.absmax)
    code = _state_field("code", lambda state: state.code)
    quant_map = _state_field("quant_map", lambda state: state.code)
    offset = _state_field("offset", lambda state: state.offset)
    state2 = _state_field("state2", lambda state: state.state2)
    nested_absmax = _state_field("nested_absmax", lambda state: state.state2.absmax, nested_only=True)
    nested_blocksize = _state_field("nested_blocksize", lambda state: state.state2.blocksize, nested_only=True)
    nested_quant_map = _state_field("nested_quant_map", lambda state: state.state2.code, nested_only=True)
    nested_dtype = _state_field("nested_dtype", lambda state: state.state2.dtype, nested_only=True)
    nested_offset = _state_field("nested_offset", lambda state: state.offset)

    def __getstate__(self) -> dict[str, Any]:
        state = {name: self.__dict__[name] for name in _FIELDS}
        state["data"] = self.data
        state["requires_grad"] = self.requires_grad
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.requires_grad = False  # until the data it applies to is in place
        self.data = state["data"]
        self.requires_grad = state["requires_grad"]
        for name in _FIELDS:
            setattr(self, name, state[name])

    def __reduce_ex__(self, protocol: int) -> tuple:
        return _rebuild_params4bit, (self.__getstate__(),)

    def __copy__(self) -> Params4bit:
        """Shares the data and the quant state, as bitsandbytes' copy does."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        return new

    def __deepcopy__(self, memo: dict) -> Params4bit:
        """Copies data and quant state; inside a copy of its layer, the copy points to the
        new layer (bitsandbytes' points to the old one, which its quantizing then updates)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = self.__getstate__()
        state["data"] = copy.deepcopy(state["data"], memo)
        state["quant_state"] = copy.deepcopy(state["quant_state"], memo)
        state["module"] = memo.get(id(self.module), self.module)
        new.__setstate__(state)
        return new

    @classmethod
    def from_prequantized(
        cls,
        data: torch.Tensor,
        quantized_stats: dict[str, Any],
        requires_grad: bool = False,
        device: torch.device | str | None = None,
        module: nn.Module | None = None,
        **kwargs: Any,
    ) -> Params4bit:
        """A quantized weight from packed codes and the quant state's serialized entries (what
        transformers reads from safetensors), all checked first (D9). ``device`` defaults to
        ``data``'s (bitsandbytes' to "cuda")."""
        check_type("data", data, torch.Tensor)
        check_type("quantized_stats", quantized_stats, dict)
        device = data.device if device is None else check_device("device", device)
        try:
            state = QuantState.from_dict(quantized_stats, device=device)
        except (TypeError, ValueError) as error:
            raise type(error)(f"quantized_stats: {error}") from None
        if state.quant_type is None:
            raise ValueError("quantized_stats describe an 8-bit blockwise state; accepted: an nf4 or fp4 state")
        packed = checks.packed_4bit("data", data, tuple(state.shape))
        self = cls(
            packed.to(device),
            requires_grad=requires_grad,
            quant_state=state,
            blocksize=state.blocksize,
            compress_statistics=state.nested,
            quant_type=state.quant_type,
            quant_storage=packed.dtype,
            module=module,
            bnb_quantized=True,
        )
        self._publish(state)
        return self

    def _publish(self, state: QuantState | None) -> None:
        """Set the quant state here and on the owning layer (which keeps it for
        :func:`fix_4bit_weight_quant_state_from_module`)."""
        self.quant_state = state
        if self.module is not None:
            self.module.quant_state = state

    def _quantize(self, device: torch.device) -> Params4bit:
        if self.is_meta:
            raise RuntimeError(
                "this Params4bit is on the meta device and holds no values to quantize; fill it first "
                "(load_state_dict(..., assign=True) or Params4bit.from_prequantized)"
            )
        packed, state = F.quantize_4bit(
            self.data.contiguous().to(device),
            blocksize=self.blocksize,
            compress_statistics=bool(self.compress_statistics),
            quant_type=self.quant_type,
            quant_storage=self.quant_storage,
        )
        self.data = packed
        self._publish(state)
        self.bnb_quantized = True
        return self

    def cpu(self) -> Params4bit:
        return self.to(device="cpu")

    def cuda(self, device: int | torch.device | str | None = None, non_blocking: bool = False) -> Params4bit:
        return self.to(device="cuda" if device is None else device, non_blocking=non_blocking)

    def xpu(self, device: int | torch.device | str | None = None, non_blocking: bool = False) -> Params4bit:
        return self.to(device="xpu" if device is None else device, non_blocking=non_blocking)

    def to(self, *args: Any, **kwargs: Any) -> Params4bit:
        """Quantizes (in place) on the first move to a device other than meta. Once
        quantized, the packed codes keep their dtype (a cast would garble them); the quant
        state moves with the data, here and on the layer, as bitsandbytes' moves in place."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type != "meta" and not self.bnb_quantized:
            return self._quantize(device)
        if self.bnb_quantized:
            dtype = None
        if device is not None and self.quant_state is not None:
            self._publish(self.quant_state.to(device))
        moved = super().to(device=device, dtype=dtype, non_blocking=non_blocking)
        return Params4bit(moved, self.requires_grad, **{name: self.__dict__[name] for name in _FIELDS})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``torch.chunk`` and ``torch.split`` give Params4bit pieces with the same fields (as in
        bitsandbytes). ``.half()``, ``.float()``, ``.bfloat16()``, ``.double()`` leave packed codes
        as they are (codes stored in a float ``quant_storage`` would be garbled by a cast)."""
        if func in _FLOAT_CASTS and isinstance(args[0], Params4bit) and args[0].bnb_quantized:
            return args[0]
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func not in (torch.chunk, torch.split):
            return result
        fields = {name: args[0].__dict__[name] for name in _FIELDS}
        requires_grad = args[0].requires_grad
        if isinstance(result, tuple):
            return tuple(cls(piece, requires_grad, **fields) for piece in result)
        return cls(result, requires_grad, **fields)


def fix_4bit_weight_quant_state_from_module(module: nn.Module) -> None:
    """Give ``module.weight`` back the quant state the layer keeps, when the weight lost it
    (FSDP, or code that replaced the parameter by a plain tensor holding the codes)."""
    if getattr(module.weight, "quant_state", None) is not None:
        return
    state = getattr(module, "quant_state", None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} is not quantized yet: call .to(device), .cpu() or .cuda() on it, "
            "or fill it with Params4bit.from_prequantized or load_state_dict"
        )
    packed = checks.packed_4bit("module.weight", module.weight.data, tuple(state.shape))
    if not isinstance(module.weight, Params4bit):
        module.weight = Params4bit(
            packed,
            blocksize=state.blocksize,
            compress_statistics=state.nested,
            quant_type=state.quant_type,
            quant_storage=packed.dtype,
            module=module,
            bnb_quantized=True,
        )
    module.weight.quant_state = state


class _Packed4bitWeight(nn.Module, abc.ABC):
    """State dicts in bitsandbytes' layout: ``weight`` (packed codes) plus ``weight.absmax``,
    ``weight.quant_map``, ``weight.nested_*`` and ``weight.quant_state.bitsandbytes__nf4``
    (or ``__fp4``). Loading such entries checks them all (D9), then replaces the weight,
    on the layer's device (the checkpoint's with ``assign=True``, and for a layer built on
    meta, which loads as with ``assign=True``); so ``strict=True`` loads work both ways
    (bitsandbytes' own layers refuse them). A plain float weight loads as into
    ``nn.Linear``, to be quantized by ``.to(device)``."""

    @abc.abstractmethod
    def _weight_shape(self) -> tuple[int, int]:
        """The shape of the float weight, which a checkpoint's quant state must decode to."""

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        state = getattr(self.weight, "quant_state", None)
        if state is not None:
            for key, value in state.as_dict(packed=True).items():
                destination[f"{prefix}weight.{key}"] = value if keep_vars else value.detach()

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
        key = prefix + "weight"
        if self.weight.is_meta:  # nothing to copy into: take the checkpoint's tensors, as assign=True does
            local_metadata = {**local_metadata, "assign_to_params_buffers": True}
        stats = {
            name: state_dict.pop(name)
            for name in list(state_dict)
            if isinstance(name, str) and name.startswith(key + ".")
        }
        rest = (state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if not stats or key not in state_dict:  # a float weight, or none (torch reports it missing)
            before = self.weight
            super()._load_from_state_dict(*rest)
            if isinstance(before, Params4bit) and not isinstance(self.weight, Params4bit):  # assign=True
                fields = {name: before.__dict__[name] for name in _FIELDS}
                self.weight = Params4bit(self.weight.data, self.weight.requires_grad, **fields)
            return
        weight = checks.dense_tensor(key, state_dict.pop(key))
        assign = local_metadata.get("assign_to_params_buffers", False)
        device = weight.device if assign else self.weight.device
        try:
            loaded = Params4bit.from_prequantized(weight, stats, device=device)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{key}: {error}") from None
        if tuple(loaded.quant_state.shape) != self._weight_shape():
            raise ValueError(
                f"{key} holds a weight of shape {tuple(loaded.quant_state.shape)}; "
                f"this layer takes {self._weight_shape()}"
            )
        errors = len(error_msgs)
        super()._load_from_state_dict(*rest)  # the bias; it sees the weight popped, as missing
        missing_keys[:] = [name for name in missing_keys if name != key]
        if len(error_msgs) == errors:
            loaded.module = self
            self.weight = loaded
            self.quant_state = loaded.quant_state


class Linear4bit(_Packed4bitWeight, nn.Linear):
    """``nn.Linear`` whose weight is quantized to NF4 or FP4 by ``.to(device)`` (QLoRA).

    The forward runs in ``compute_dtype`` (by default the first input's, when that is
    float32 or bfloat16) and returns the input's dtype; it is differentiable in the input
    and the bias, so trainable adapters on a frozen 4-bit base train.
    """

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        compute_dtype: torch.dtype | None = None,
        compress_statistics: bool = True,
        quant_type: str = "fp4",
        quant_storage: torch.dtype = torch.uint8,
        device: torch.device | str | None = None,
    ) -> None:
        _check_size("input_features", input_features)
        _check_size("output_features", output_features)
        check_type("bias", bias, bool)
        _check_optional_float_dtype("compute_dtype", compute_dtype)
        _check_format(64, compress_statistics, quant_type, quant_storage)
        super().__init__(input_features, output_features, bias, device)
        self.weight = Params4bit(
            self.weight.data,
            requires_grad=False,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            quant_storage=quant_storage,
            module=self,
        )
        self.compute_dtype = compute_dtype
        self.compute_type_is_set = compute_dtype is not None
        self.quant_state: QuantState | None = None
        self.quant_storage = quant_storage

    def _weight_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def set_compute_type(self, x: torch.Tensor) -> None:
        """float32 and bfloat16 inputs set the compute dtype; a float16 input keeps the one
        given (and a warning says float32 compute is slow), as in bitsandbytes."""
        if x.dtype in (torch.float32, torch.bfloat16):
            self.compute_dtype = x.dtype
        elif x.dtype == torch.float16 and self.compute_dtype in (None, torch.float32):
            logger.warning(
                "Input type into Linear4bit is torch.float16, but compute_dtype is float32 (the default); "
                "this makes inference%s slow.",
                "" if x.numel() == x.shape[-1] else " and training",
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fix_4bit_weight_quant_state_from_module(self)
        check_type("x", x, torch.Tensor)
        if not self.compute_type_is_set:
            self.set_compute_type(x)
            self.compute_type_is_set = True
        input_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"x has dtype {x.dtype}; accepted: float32, float16, bfloat16 (or set compute_dtype)")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x has shape {tuple(x.shape)}; accepted: (..., {self.in_features}), in_features last")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.matmul_4bit(x, self.weight.data, self.weight.quant_state, bias=bias).to(input_dtype)


class LinearFP4(Linear4bit):
    """:class:`Linear4bit` with ``quant_type="fp4"``."""

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        compute_dtype: torch.dtype | None = None,
        compress_statistics: bool = True,
        quant_storage: torch.dtype = torch.uint8,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            input_features, output_features, bias, compute_dtype, compress_statistics, "fp4", quant_storage, device
        )


class LinearNF4(Linear4bit):
    """:class:`Linear4bit` with ``quant_type="nf4"`` (normal-quantile levels, QLoRA's choice)."""

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        compute_dtype: torch.dtype | None = None,
        compress_statistics: bool = True,
        quant_storage: torch.dtype = torch.uint8,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            input_features, output_features, bias, compute_dtype, compress_statistics, "nf4", quant_storage, device
        )


class Embedding4bit(_Packed4bitWeight, nn.Embedding):
    """``nn.Embedding`` whose table is quantized to NF4 or FP4 by ``.to(device)``; looked-up
    rows are decoded alone when ``embedding_dim`` is a multiple of the blocksize (each row
    then owns whole blocks), else the table is decoded. Unlike bitsandbytes', it saves
    and loads its state dict, in the layout of :class:`Linear4bit`."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        quant_type: str = "fp4",
        quant_storage: torch.dtype = torch.uint8,
        device: torch.device | str | None = None,
    ) -> None:
        _check_size("num_embeddings", num_embeddings)
        _check_size("embedding_dim", embedding_dim)
        _check_optional_float_dtype("dtype", dtype)
        _check_format(64, None, quant_type, quant_storage)
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.dtype = self.weight.dtype
        self.weight = Params4bit(
            self.weight.data,
            requires_grad=False,
            compress_statistics=None,
            quant_type=quant_type,
            quant_storage=quant_storage,
            module=self,
        )
        self.quant_state: QuantState | None = None
        if embedding_dim % self.weight.blocksize:
            logger.warning(
                "Embedding size %d is not divisible by block size %d; every lookup decodes the whole table.",
                embedding_dim,
                self.weight.blocksize,
            )

    def _weight_shape(self) -> tuple[int, int]:
        return (self.num_embeddings, self.embedding_dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        fix_4bit_weight_quant_state_from_module(self)
        _check_indices(input, self.num_embeddings)
        state = self.weight.quant_state
        if self.embedding_dim % state.blocksize or state.nested:
            table = F.dequantize_4bit(self.weight.data, state)
            return nn.functional.embedding(input, table).to(self.dtype)
        rows = self.weight.data.view(torch.uint8).reshape(self.num_embeddings, self.embedding_dim // 2)
        scales = state.absmax.view(self.num_embeddings, self.embedding_dim // state.blocksize)
        picked = dataclasses.replace(
            state,
            absmax=nn.functional.embedding(input, scales).reshape(-1),
            shape=torch.Size((*input.shape, self.embedding_dim)),
        )
        return F.dequantize_4bit(nn.functional.embedding(input, rows), picked).to(self.dtype)


class EmbeddingFP4(Embedding4bit):
    """:class:`Embedding4bit` with ``quant_type="fp4"``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        quant_storage: torch.dtype = torch.uint8,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, dtype=dtype, quant_type="fp4", quant_storage=quant_storage, device=device
        )


class EmbeddingNF4(Embedding4bit):
    """:class:`Embedding4bit` with ``quant_type="nf4"``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype | None = None,
        quant_storage: torch.dtype = torch.uint8,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, dtype=dtype, quant_type="nf4", quant_storage=quant_storage, device=device
        )
