"""The 8-bit layers of ``bitsandbytes.nn`` on tightfit: ``Linear8bitLt`` and
``Embedding8bit``, whose weight is an ``Int8Params`` (``_params``), with bitsandbytes'
constructor arguments, attributes and state dict layout (``weight`` int8, ``SCB``
float32, ``weight_format`` 0), so code written for it works by changing the import and
checkpoints load both ways with ``strict=True``.

As in bitsandbytes, a layer holds its float weight until ``.to(device)`` (``.cpu()``,
``.cuda()``) quantizes it (unless ``has_fp16_weights``). The weight parameter is the
source of truth: ``layer.state.CB``/``SCB`` mirror it after quantization, loading,
moving and casting (bitsandbytes fills them at the first forward), and casting
(``.half()``) changes the bias only. Also bitsandbytes' float ``Embedding`` and
``StableEmbedding`` (their initialization and LayerNorm; no optimizer registration).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tightfit import ops
from tightfit._validate import check_non_negative_number, check_type
from tightfit.compat.bitsandbytes._autograd8bit import MatmulLtState, matmul, quantize_weight
from tightfit.compat.bitsandbytes._common import check_indices, check_optional_tensor, check_size, fixed_argument
from tightfit.compat.bitsandbytes._params import Int8Params
from tightfit.quant import _checkpoint as checks
from tightfit.quant.modules import _check_input

__all__ = ["Embedding", "Embedding8bit", "Linear8bitLt", "StableEmbedding"]


def _float_entry(name: str, value: object, shape: tuple[int, int]) -> torch.Tensor:
    """A float weight from a checkpoint (D9); an int8 one comes with its ``SCB``."""
    weight = checks.dense_tensor(name, value)
    if weight.dtype == torch.int8:
        raise ValueError(f"{name} is int8 but its SCB entry is missing; an int8 weight needs its row scales")
    if not weight.is_floating_point():
        raise TypeError(f"{name} has dtype {weight.dtype}; accepted: int8 (with SCB) or a floating-point dtype")
    if tuple(weight.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(weight.shape)}; accepted: {shape}")
    return weight


def _check_weight_format(name: str, value: object) -> None:
    """bitsandbytes reads the layout as a tensor, its number or its name; only row-major
    (0, ``"row"``) exists since 0.45."""
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        if value not in (0, "row"):
            raise ValueError(f"{name}={value!r:.80} is not accepted; accepted: 0 or 'row' (row-major)")
        return
    checks.weight_format(name, value)


def _quantized(weight: torch.Tensor, device: torch.device) -> Int8Params:
    """A new quantized weight from a float one that is no ``Int8Params`` to quantize in place
    (a checkpoint's entry, a plain parameter set on the layer)."""
    CB, SCB = quantize_weight(weight.to(device))
    return Int8Params(CB, False, has_fp16_weights=False, CB=CB, SCB=SCB)


class _Int8Weight(nn.Module):
    """What the 8-bit layers share: casts leave the int8 weight and its float32 scales as
    they are, and moves bring the scales along (torch moves a parameter in place, which
    drops the copy ``Int8Params.to`` made with them)."""

    def _sync_state(self) -> None:
        """Bring what mirrors the weight up to date (``Linear8bitLt.state``)."""

    def _apply(self, fn: Any, recurse: bool = True) -> _Int8Weight:
        scales = getattr(self.weight, "SCB", None)
        super()._apply(fn, recurse)
        weight = self.weight
        if weight.dtype == torch.int8:
            if not isinstance(weight, Int8Params):  # torch's overwrite-on-conversion mode rebuilt it
                weight = self.weight = Int8Params(weight.data, False)
            current = weight.SCB if weight.SCB is not None else scales
            weight.SCB = None if current is None else current.to(weight.device)
            weight.CB = weight.data
            self._sync_state()
        return self

    def _placement(self, local_metadata: dict, entry: object) -> tuple[bool, torch.device]:
        """Whether loading replaces the weight with the entries' tensors (``assign=True``,
        or a layer built on meta) and the device they go to."""
        share = bool(local_metadata.get("assign_to_params_buffers", False))
        replace = share or self.weight.is_meta
        device = entry.device if replace and isinstance(entry, torch.Tensor) else self.weight.device
        return share, device

    def _int8_entries(
        self, prefix: str, entries: dict[str, Any], shape: tuple[int, int], device: torch.device, share: bool
    ) -> Int8Params:
        """An int8 weight and its row scales from a checkpoint (D9), as an ``Int8Params``."""
        weight = checks.exact_tensor(prefix + "weight", entries["weight"], torch.int8, shape).to(device, copy=not share)
        scales = checks.scales(prefix + "SCB", entries["SCB"], shape[0]).to(device, copy=not share)
        return Int8Params(weight, False, has_fp16_weights=False, CB=weight, SCB=scales)


class Linear8bitLt(_Int8Weight, nn.Linear):
    """LLM.int8() linear layer, bitsandbytes' constructor: the weight is float until
    ``.to(device)`` quantizes it when ``has_fp16_weights`` is False; with it True the
    weight stays float (and trainable) and is quantized at every call. Input columns
    holding a value of magnitude >= ``threshold`` (> 0) are multiplied in the input's
    dtype. The forward is ``tightfit.ops.int8_linear``: differentiable in the input and
    bias; the int8 weight is frozen."""

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        has_fp16_weights: bool = True,
        threshold: float = 0.0,
        index: Any = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_size("input_features", input_features, 0)
        check_size("output_features", output_features, 0)
        check_type("bias", bias, bool)
        check_type("has_fp16_weights", has_fp16_weights, bool)
        threshold = check_non_negative_number("threshold", threshold)
        super().__init__(input_features, output_features, bias, device)
        self.state = MatmulLtState(threshold=threshold, has_fp16_weights=has_fp16_weights)
        self.state.use_pool = threshold > 0.0 and not has_fp16_weights
        self.index = index
        self.weight = Int8Params(self.weight.data, has_fp16_weights=has_fp16_weights, requires_grad=has_fp16_weights)

    def _sync_state(self) -> None:
        """Point ``state.CB``/``SCB`` (and ``weight.CB``) at the int8 weight and its scales."""
        weight = self.weight
        if weight.dtype == torch.int8:
            weight.CB = weight.data
            self.state.CB, self.state.SCB = weight.CB, getattr(weight, "SCB", None)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        scales = getattr(self.weight, "SCB", None)  # None for a plain parameter set by hand (tied weights)
        if not self.state.has_fp16_weights and self.weight.dtype == torch.int8 and scales is not None:
            destination[prefix + "SCB"] = scales if keep_vars else scales.detach()
            destination[prefix + "weight_format"] = torch.tensor(0, dtype=torch.uint8)

    def _checked_weight(self, prefix: str, entries: dict[str, Any], device: torch.device, share: bool) -> torch.Tensor:
        """The new weight from a checkpoint's entries (D9): int8 with ``SCB`` (an
        ``Int8Params``), or float: quantized when this layer already is, else returned
        checked for the caller to copy or assign."""
        shape = (self.out_features, self.in_features)
        if "weight_format" in entries:
            _check_weight_format(prefix + "weight_format", entries["weight_format"])
        if "SCB" in entries:
            if not isinstance(self.weight, Int8Params):
                raise RuntimeError(
                    f"Loading a quantized checkpoint into non-quantized Linear8bitLt is not supported: {prefix}weight "
                    "is a plain parameter (set by hand or tied to another module), which an int8 weight would replace "
                    "and so untie; load it into the layer's own Int8Params weight"
                )
            if self.state.has_fp16_weights:
                raise ValueError(
                    f"{prefix}SCB: an int8 checkpoint loads into a layer made with has_fp16_weights=False; "
                    "this one has has_fp16_weights=True"
                )
            return self._int8_entries(prefix, entries, shape, device, share)
        weight = _float_entry(prefix + "weight", entries["weight"], shape)
        return _quantized(weight, device) if self.weight.dtype == torch.int8 else weight

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
        """bitsandbytes' entries, all checked before any is applied; an absent ``weight``
        or ``bias`` is reported missing (``strict=True`` fails), the layer unchanged."""
        names = ("weight", "SCB", "weight_format") + (("bias",) if self.bias is not None else ())
        entries = {name: state_dict.pop(prefix + name) for name in names if prefix + name in state_dict}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        ours = {prefix + "weight", prefix + "bias"}
        missing_keys[:] = [key for key in missing_keys if key not in ours]
        missing_keys.extend(prefix + name for name in ("weight", "bias") if name in names and name not in entries)
        if "weight" not in entries:
            if "SCB" in entries:
                raise ValueError(f"{prefix}SCB is given without {prefix}weight; the scales belong to an int8 weight")
            return
        share, device = self._placement(local_metadata, entries["weight"])
        replace = share or self.weight.is_meta
        weight = self._checked_weight(prefix, entries, device, share)
        bias = checks.bias(prefix + "bias", entries["bias"], self.bias) if "bias" in entries else None
        if isinstance(weight, Int8Params):
            self.weight = weight
        elif replace:
            self.weight = Int8Params(
                weight.to(device, copy=not share),
                self.weight.requires_grad,
                has_fp16_weights=self.state.has_fp16_weights,
            )
        else:
            with torch.no_grad():
                self.weight.copy_(weight)  # the same parameter object, as torch's own loading keeps it
        if bias is not None and replace:
            self.bias = nn.Parameter(bias.to(device, copy=not share), requires_grad=self.bias.requires_grad)
        elif bias is not None:
            with torch.no_grad():
                self.bias.copy_(bias)
        self._sync_state()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.in_features)
        self.state.is_training = self.training
        weight = self.weight
        if weight.dtype != torch.int8 and not self.state.has_fp16_weights:
            # bitsandbytes also swaps in the int8 weight at the first call
            if isinstance(weight, Int8Params):
                weight._quantize(weight.device)
            else:  # a plain parameter set by hand
                self.weight = _quantized(weight.detach(), weight.device)
        self._sync_state()
        return matmul(x, self.weight, bias=self.bias, state=self.state)


class Embedding8bit(_Int8Weight, nn.Embedding):
    """An embedding table quantized per row to int8 on ``.to(device)``, looked up and
    decoded (``row * SCB / 127``) into the dtype it was built with. Its state dict holds
    ``weight`` (int8) and ``SCB`` (bitsandbytes' own refuses to save)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_size("num_embeddings", num_embeddings, 0)
        check_size("embedding_dim", embedding_dim, 0)
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.dtype = self.weight.data.dtype
        self.weight = Int8Params(self.weight.data, has_fp16_weights=False, requires_grad=False)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.dtype == torch.int8 and self.weight.SCB is not None:
            destination[prefix + "SCB"] = self.weight.SCB if keep_vars else self.weight.SCB.detach()

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
        """A float table (from ``nn.Embedding``) loads as torch loads it, for ``.to()`` to
        quantize, or is quantized at once into a quantized table; an int8 one comes with
        its ``SCB``. Entries are checked (D9)."""
        shape = (self.num_embeddings, self.embedding_dim)
        if prefix + "weight" not in state_dict:
            if prefix + "SCB" in state_dict:
                raise ValueError(f"{prefix}SCB is given without {prefix}weight; the scales belong to an int8 table")
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
            return
        if prefix + "SCB" in state_dict:
            entries = {name: state_dict.pop(prefix + name) for name in ("weight", "SCB")}
            share, device = self._placement(local_metadata, entries["weight"])
            weight = self._int8_entries(prefix, entries, shape, device, share)
        else:
            table = _float_entry(prefix + "weight", state_dict[prefix + "weight"], shape)
            if self.weight.dtype != torch.int8:
                super()._load_from_state_dict(
                    state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
                )
                return
            del state_dict[prefix + "weight"]
            weight = _quantized(table, self._placement(local_metadata, table)[1])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        missing_keys[:] = [key for key in missing_keys if key != prefix + "weight"]
        self.weight = weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.int8 or self.weight.SCB is None:
            raise RuntimeError("Embedding8bit is not quantized yet: call .to(device) (or .cpu(), .cuda()) first")
        check_indices(input, self.num_embeddings)
        rows = F.embedding(input, self.weight.data)
        scales = F.embedding(input, self.weight.SCB.view(self.num_embeddings, 1))
        return ops.int8_vectorwise_dequant(rows, scales).to(self.dtype)


class _XavierEmbedding(nn.Embedding):
    """bitsandbytes' float embeddings: an ``nn.Embedding`` initialized Xavier-uniform
    (the padding row zero), arguments checked before torch's own asserts. bitsandbytes
    also registers them for 32-bit state in its own optimizers; tightfit has none, so
    that part has no counterpart (any torch optimizer treats them as any parameter)."""

    #: Whether looked-up rows go through a LayerNorm, ``norm`` (``StableEmbedding``).
    _normalized = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_size("num_embeddings", num_embeddings, 0)
        check_size("embedding_dim", embedding_dim, 0)
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
                raise TypeError(
                    f"padding_idx must be int or None, got {type(padding_idx).__name__}: {padding_idx!r:.80}"
                )
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"padding_idx={padding_idx} is not accepted; accepted: -{num_embeddings} to {num_embeddings - 1}"
                )
        check_optional_tensor("_weight", _weight)
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"_weight has shape {tuple(_weight.shape)}; accepted: {(num_embeddings, embedding_dim)}")
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            device=device,
            dtype=dtype,
        )
        if self._normalized:
            self.norm = nn.LayerNorm(embedding_dim, device=device)

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight)
        self._fill_padding_idx_with_zero()


class Embedding(_XavierEmbedding):
    """bitsandbytes' ``Embedding`` (see ``_XavierEmbedding``); like it, no ``dtype``."""

    __init__ = fixed_argument(_XavierEmbedding.__init__, "dtype", None, qualname="Embedding.__init__")


class StableEmbedding(_XavierEmbedding):
    """bitsandbytes' ``StableEmbedding``: the looked-up rows go through a LayerNorm
    (``norm``, in the default dtype) and back to the table's dtype. The norm is part of
    the model (``norm.weight``, ``norm.bias`` in its state dict), so it is kept."""

    _normalized = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input).to(torch.get_default_dtype())
        return self.norm(rows).to(self.weight.dtype)
