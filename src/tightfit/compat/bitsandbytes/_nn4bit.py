"""The 4-bit layers of ``bitsandbytes.nn`` on tightfit's kernels (``Linear4bit``,
``Embedding4bit`` and their NF4 / FP4 shorthands), with bitsandbytes 0.50's constructor
arguments, defaults and attributes; their weight is a ``Params4bit`` (``_params``).

A layer holds a float weight until ``.to(device)`` / ``.cpu()`` / ``.cuda()`` quantizes it
(``Params4bit.bnb_quantized``), or it is filled with packed codes read from a checkpoint
(``Params4bit.from_prequantized``, or ``load_state_dict`` with bitsandbytes' keys).
Quantizing and the forward go through :mod:`tightfit.quant.functional`, so they follow the
tensor's device (D1). Where this differs from bitsandbytes it is said at the name.
"""

from __future__ import annotations

import abc
import dataclasses
import logging

import torch
from torch import nn

from tightfit._validate import check_choice, check_type
from tightfit.compat.bitsandbytes._common import check_indices, check_size, fixed_argument
from tightfit.compat.bitsandbytes._params import Params4bit, check_4bit_format
from tightfit.ops._arg_checks import FLOAT_DTYPES
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
    "fix_4bit_weight_quant_state_from_module",
]

logger = logging.getLogger(__name__)


def _check_optional_float_dtype(name: str, dtype: object) -> None:
    if dtype is not None:
        check_type(name, dtype, torch.dtype)
        check_choice(name, dtype, FLOAT_DTYPES)


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
    if isinstance(module.weight, Params4bit):
        module.weight.quant_state = state
    else:
        module.weight = Params4bit._from_packed(packed, state, module=module)


class _Packed4bitWeight(nn.Module, abc.ABC):
    """State dicts in bitsandbytes' layout: ``weight`` (packed codes) plus ``weight.absmax``,
    ``weight.quant_map``, ``weight.nested_*`` and ``weight.quant_state.bitsandbytes__nf4``
    (or ``__fp4``). Loading such entries checks them all (D9), then replaces the weight,
    on the layer's device (the checkpoint's with ``assign=True``, and for a layer built on
    meta, which loads as with ``assign=True``); so ``strict=True`` loads work both ways
    (bitsandbytes' own layers refuse them). A plain float weight loads as into
    ``nn.Linear``, to be quantized by ``.to(device)``."""

    def _hold_float_weight(self, compress_statistics: bool | None, quant_type: str, quant_storage: torch.dtype) -> None:
        """Wrap the float weight torch's layer built in a Params4bit, which ``.to(device)``
        quantizes; until then the layer has no quant state."""
        self.weight = Params4bit(
            self.weight.data,
            requires_grad=False,
            compress_statistics=compress_statistics,
            quant_type=quant_type,
            quant_storage=quant_storage,
            module=self,
        )
        self.quant_state: QuantState | None = None

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
                self.weight = Params4bit(self.weight.data, self.weight.requires_grad, **before._fields())
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
        check_size("input_features", input_features, 1)
        check_size("output_features", output_features, 1)
        check_type("bias", bias, bool)
        _check_optional_float_dtype("compute_dtype", compute_dtype)
        check_4bit_format(64, compress_statistics, quant_type, quant_storage)
        super().__init__(input_features, output_features, bias, device)
        self._hold_float_weight(compress_statistics, quant_type, quant_storage)
        self.compute_dtype = compute_dtype
        self.compute_type_is_set = compute_dtype is not None
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
        # the bias is cast in the add, rounded once, so eager and torch.compile (which fuses the cast) agree
        return F.matmul_4bit(x, self.weight.data, self.weight.quant_state, bias=self.bias).to(input_dtype)


class LinearFP4(Linear4bit):
    """:class:`Linear4bit` with ``quant_type="fp4"``."""

    __init__ = fixed_argument(Linear4bit.__init__, "quant_type", "fp4", qualname="LinearFP4.__init__")


class LinearNF4(Linear4bit):
    """:class:`Linear4bit` with ``quant_type="nf4"`` (normal-quantile levels, QLoRA's choice)."""

    __init__ = fixed_argument(Linear4bit.__init__, "quant_type", "nf4", qualname="LinearNF4.__init__")


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
        check_size("num_embeddings", num_embeddings, 1)
        check_size("embedding_dim", embedding_dim, 1)
        _check_optional_float_dtype("dtype", dtype)
        check_4bit_format(64, None, quant_type, quant_storage)
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.dtype = self.weight.dtype
        self._hold_float_weight(None, quant_type, quant_storage)
        if embedding_dim % self.weight.blocksize:
            logger.warning(
                "Embedding size %d is not divisible by block size %d; every lookup decodes the whole table, "
                "which makes inference slow.",
                embedding_dim,
                self.weight.blocksize,
            )

    def _weight_shape(self) -> tuple[int, int]:
        return (self.num_embeddings, self.embedding_dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        fix_4bit_weight_quant_state_from_module(self)
        check_indices(input, self.num_embeddings)
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

    __init__ = fixed_argument(Embedding4bit.__init__, "quant_type", "fp4", qualname="EmbeddingFP4.__init__")


class EmbeddingNF4(Embedding4bit):
    """:class:`Embedding4bit` with ``quant_type="nf4"``."""

    __init__ = fixed_argument(Embedding4bit.__init__, "quant_type", "nf4", qualname="EmbeddingNF4.__init__")
