"""bitsandbytes' parameter classes on tightfit: ``Params4bit`` (NF4 / FP4) and
``Int8Params`` (LLM.int8()). Each holds a float weight until its first move to a device
that holds data quantizes it through tightfit's dispatched ops (D1), and carries the
attributes code written for bitsandbytes reads (``quant_state``, ``CB``, ``SCB``, ...)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tightfit._validate import check_choice, check_device, check_type
from tightfit.compat.bitsandbytes._autograd8bit import quantize_weight
from tightfit.compat.bitsandbytes._common import check_optional_tensor
from tightfit.ops._arg_checks import BLOCKSIZES_4BIT, PACKED_DTYPES, check_blocksize, check_quant_type
from tightfit.quant import _checkpoint as checks
from tightfit.quant import functional as F
from tightfit.quant.state import QuantState

__all__ = ["Int8Params", "Params4bit"]


_FLOAT_CASTS = (torch.Tensor.half, torch.Tensor.float, torch.Tensor.bfloat16, torch.Tensor.double)


def check_4bit_format(
    blocksize: object, compress_statistics: object, quant_type: object, quant_storage: object
) -> None:
    check_blocksize(blocksize, BLOCKSIZES_4BIT)
    if compress_statistics is not None:  # bitsandbytes' embeddings pass None for "no"
        check_type("compress_statistics", compress_statistics, bool)
    check_quant_type(quant_type)
    check_type("quant_storage", quant_storage, torch.dtype)
    check_choice("quant_storage", quant_storage, PACKED_DTYPES)


def _rebuild(cls: type[_QuantizedParameter], state: dict[str, Any]) -> _QuantizedParameter:
    """Unpickling: the parameter's own class again, with its fields."""
    param = cls()
    param.__setstate__(state)
    return param


class _QuantizedParameter(nn.Parameter):
    """What both parameter classes do, as bitsandbytes' do: ``.cpu()``, ``.cuda()`` and
    ``.xpu()`` are moves through ``.to()`` (so the first one quantizes), and copies and
    ``copy.copy`` and pickles keep the class and the fields named in ``_FIELDS``
    (``nn.Parameter``'s own reduction would give a plain Parameter)."""

    #: What it carries besides its data and ``requires_grad`` (its ``__dict__``).
    _FIELDS: tuple[str, ...] = ()

    def cpu(self) -> torch.Tensor:
        return self.to(device="cpu")

    def cuda(self, device: int | torch.device | str | None = None, non_blocking: bool = False) -> torch.Tensor:
        return self.to(device="cuda" if device is None else device, non_blocking=non_blocking)

    def xpu(self, device: int | torch.device | str | None = None, non_blocking: bool = False) -> torch.Tensor:
        return self.to(device="xpu" if device is None else device, non_blocking=non_blocking)

    def _fields(self) -> dict[str, Any]:
        """The fields, as keyword arguments to the constructor."""
        return {name: self.__dict__[name] for name in self._FIELDS}

    def __getstate__(self) -> dict[str, Any]:
        state = self._fields()
        state["data"] = self.data
        state["requires_grad"] = self.requires_grad
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.requires_grad = False  # until the data it applies to is in place
        self.data = state["data"]
        self.requires_grad = state["requires_grad"]
        for name in self._FIELDS:
            setattr(self, name, state[name])

    def __reduce_ex__(self, protocol: int) -> tuple:
        return _rebuild, (type(self), self.__getstate__())

    def __copy__(self) -> _QuantizedParameter:
        """Shares the data and the fields (the quant state, the scales), as bitsandbytes' copy does."""
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        return new


def _state_field(name: str, read: Any, nested_only: bool = False) -> property:
    """A read-only view of the QuantState's ``name`` (bitsandbytes has them so that FSDP
    finds the state dict's ``weight.absmax``, ... by ``getattr`` on the weight)."""

    def get(self: Params4bit) -> Any:
        state = self.__dict__.get("quant_state")
        if state is not None and (state.nested or not nested_only):
            return read(state)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    return property(get, doc=f"The quant state's {name}.")


class Params4bit(_QuantizedParameter):
    """A weight that is float until moved to a device, packed 4-bit codes after.

    Unknown keyword arguments are ignored, as bitsandbytes does: transformers rebuilds a
    parameter with ``Params4bit(value, **old.__dict__)``.
    """

    _FIELDS = (
        "blocksize",
        "compress_statistics",
        "quant_type",
        "quant_state",
        "quant_storage",
        "bnb_quantized",
        "module",
    )

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
        check_4bit_format(blocksize, compress_statistics, quant_type, quant_storage)
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
        self = cls._from_packed(packed.to(device), state, requires_grad, module)
        self._publish(state)
        return self

    @classmethod
    def _from_packed(
        cls, packed: torch.Tensor, state: QuantState, requires_grad: bool = False, module: nn.Module | None = None
    ) -> Params4bit:
        """A quantized weight of packed codes already checked against their 4-bit ``state``."""
        return cls(
            packed,
            requires_grad=requires_grad,
            quant_state=state,
            blocksize=state.blocksize,
            compress_statistics=state.nested,
            quant_type=state.quant_type,
            quant_storage=packed.dtype,
            module=module,
            bnb_quantized=True,
        )

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
        return Params4bit(moved, self.requires_grad, **self._fields())

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
        fields = args[0]._fields()
        requires_grad = args[0].requires_grad
        if isinstance(result, tuple):
            return tuple(cls(piece, requires_grad, **fields) for piece in result)
        return cls(result, requires_grad, **fields)


class Int8Params(_QuantizedParameter):
    """A weight that is float until moved to a device, then int8 (``data`` and ``CB``)
    with float32 row scales ``SCB``; with ``has_fp16_weights`` it stays float. Extra
    keyword arguments are ignored, as bitsandbytes does (transformers passes a
    parameter's ``__dict__``); ``requires_grad`` applies to float data only (int8 has no
    gradient)."""

    _FIELDS = ("CB", "SCB", "has_fp16_weights")

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = True,
        has_fp16_weights: bool = False,
        CB: torch.Tensor | None = None,
        SCB: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Int8Params:
        check_optional_tensor("data", data)
        check_type("requires_grad", requires_grad, bool)
        check_type("has_fp16_weights", has_fp16_weights, bool)
        check_optional_tensor("CB", CB)
        check_optional_tensor("SCB", SCB)
        data = torch.empty(0) if data is None else data
        obj = torch.Tensor._make_subclass(cls, data, requires_grad and data.is_floating_point())
        obj.CB = CB
        obj.SCB = SCB
        obj.has_fp16_weights = has_fp16_weights
        return obj

    def _quantize(self, device: torch.device | str | None) -> Int8Params:
        """Quantize in place (on ``device``); with ``has_fp16_weights`` only move."""
        if self.has_fp16_weights:
            return Int8Params(super().to(device), self.requires_grad, has_fp16_weights=True)
        CB, SCB = quantize_weight(self.data.to(device))
        self.requires_grad_(False)
        self.data = CB
        self.CB = CB
        self.SCB = SCB
        return self

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Moving float data to a device that holds data quantizes it; an int8 weight
        moves with its ``SCB``. Converting int8 codes to another dtype gives a plain tensor
        of those numbers (module casts never ask it: they leave integer tensors alone)."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        quantized = self.dtype == torch.int8
        if not quantized and device is not None and device.type != "meta" and not self.is_meta:
            return self._quantize(device)
        if quantized and dtype not in (None, torch.int8):
            return super().to(*args, **kwargs)
        moved = Int8Params(
            super().to(device=device, dtype=dtype, non_blocking=non_blocking),
            self.requires_grad,
            has_fp16_weights=self.has_fp16_weights,
        )
        if quantized:
            moved.CB = moved.data
            if self.SCB is not None:
                moved.SCB = self.SCB if device is None else self.SCB.to(device)
        return moved

    def __deepcopy__(self, memo: dict) -> Int8Params:
        """An Int8Params again, with its own copy of the codes and the scales."""
        new = type(self)(
            copy.deepcopy(self.data, memo),
            self.requires_grad,
            has_fp16_weights=self.has_fp16_weights,
            CB=copy.deepcopy(self.CB, memo),
            SCB=copy.deepcopy(self.SCB, memo),
        )
        memo[id(self)] = new
        return new
