"""The KV cache of a causal LM's generation (private): its formats, their bytes to the
byte, and the cache object a forward is given.

Formats (``tightfit run --kv-cache``):

- ``model``: keys and values in the model's dtype (transformers' ``DynamicCache``);
- ``float8``: keys and values in float8 (e4m3), one float32 scale per position and head
  (the largest magnitude over the head's dimension maps to float8's largest value), so
  that a position's quantization never depends on later ones and the stored bytes grow
  by a fixed amount per token. A layer's forward decodes its whole cache into the
  model's dtype for its attention; that copy (keys and values of one layer at the
  context) is alive only while the layer attends, and the plan reserves it.

A cache grows by :func:`bytes_per_token` per position: keys and values of every layer.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from tightfit._format import human_bytes

__all__: list[str] = []

KV_FORMATS = ("model", "float8")
_FLOAT8 = torch.float8_e4m3fn
_FLOAT8_MAX = torch.finfo(_FLOAT8).max
_SCALE_BYTES = 4  # float32, one per position and head


def _shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dimension) of the self-attention that caches: a causal LM's,
    or an encoder-decoder's decoder (T5: ``num_decoder_layers``, ``d_kv``)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or config.hidden_size // heads
    layers = getattr(config, "num_decoder_layers", None) if getattr(config, "is_encoder_decoder", False) else None
    return layers or config.num_hidden_layers, kv_heads, head_dim


def bytes_per_token(config: Any, dtype: torch.dtype, kv_format: str = "model") -> int:
    """Bytes the KV cache grows by per position: keys and values of every layer, in
    ``kv_format`` (float8: a byte per value and a float32 scale per head)."""
    layers, kv_heads, head_dim = _shape(config)
    if kv_format == "float8":
        return 2 * layers * kv_heads * (head_dim + _SCALE_BYTES)
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


def decoded_bytes(config: Any, dtype: torch.dtype, kv_format: str, context: int) -> int:
    """What a forward holds above the cache while one layer attends: a float8 cache's keys
    and values of that layer decoded into ``dtype`` at ``context`` positions (0 for the
    model's format, which is read as it is)."""
    if kv_format != "float8":
        return 0
    _, kv_heads, head_dim = _shape(config)
    return 2 * kv_heads * head_dim * context * dtype.itemsize


def describe(kv_format: str, config: Any, dtype: torch.dtype) -> str:
    """The format in words, with its bytes per position."""
    per_token = human_bytes(bytes_per_token(config, dtype, kv_format))
    if kv_format == "float8":
        return f"float8 KV cache ({per_token} a position, a float32 scale per position and head)"
    return f"KV cache in {str(dtype).removeprefix('torch.')} ({per_token} a position)"


def _float8_layer_class() -> type:
    """transformers' dynamic cache layer, storing float8 (defined on first use: transformers
    is imported only by a run that generates)."""
    from transformers.cache_utils import DynamicLayer

    class Float8Layer(DynamicLayer):
        """A dynamic layer whose keys and values are stored in float8 with a scale per
        position and head; ``update`` returns them decoded into the states' dtype."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self.dtype = key_states.dtype
            self.keys = self.keys.to(_FLOAT8)
            self.values = self.values.to(_FLOAT8)
            empty = torch.empty(0, device=self.device)
            self.key_scales, self.value_scales = empty, empty

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.key_scales = _append(self.keys, self.key_scales, key_states)
            self.values, self.value_scales = _append(self.values, self.value_scales, value_states)
            return _decode(self.keys, self.key_scales, self.dtype), _decode(self.values, self.value_scales, self.dtype)

    return Float8Layer


def _append(stored: torch.Tensor, scales: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` (batch, heads, positions, head_dim) quantized and appended to the stored
    codes and scales along the positions."""
    scale = states.detach().abs().amax(dim=-1, keepdim=True).float().div_(_FLOAT8_MAX)
    scale.clamp_(min=torch.finfo(torch.float32).tiny)  # an all-zero row keeps a usable scale
    codes = (states.float() / scale).to(_FLOAT8)
    if stored.numel() == 0:
        return codes, scale
    return torch.cat([stored, codes], dim=-2), torch.cat([scales, scale], dim=-2)


def _decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float8 codes times their scales, in ``dtype``: one copy of the layer's keys or values."""
    return codes.to(dtype).mul_(scales.to(dtype))


def cache_argument(model: Any, kv_format: str = "model") -> dict[str, Any]:
    """A new, empty KV cache for ``model`` in ``kv_format``, as the keyword its forward
    takes it by.

    transformers asks for a ``Cache`` object made up front (a tuple of tensors, the legacy
    cache, is deprecated) and, from 5.x, calls the argument ``cache`` (``past_key_values``
    warns a FutureWarning and goes in 5.40). The object is updated in place by every
    forward, so the same one is passed again while decoding. Before 4.56 DynamicCache
    takes no config, and has no layers to store float8 in.
    """
    from transformers import DynamicCache

    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format={kv_format!r} is not accepted; accepted: {', '.join(KV_FORMATS)}")
    config = getattr(model, "config", None)
    if config is not None and "config" in inspect.signature(DynamicCache).parameters:
        cache = DynamicCache(config=config)
    else:
        cache = DynamicCache()
    if kv_format == "float8":
        _store_float8(cache, config)
    return {cache_keyword(model): cache}


def returned_cache(output: Any) -> Any:
    """The cache a forward returns (an encoder-decoder makes its own at the first step),
    under the name this transformers gives it: ``cache`` from 5.x, ``past_key_values`` before."""
    return output.cache if "cache" in output else output.past_key_values


def cache_keyword(model: Any) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` from transformers 5.x,
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _store_float8(cache: Any, config: Any) -> None:
    """Replace ``cache``'s layers by float8 ones; refused where its layers are not plain
    full-attention ones (sliding windows, other kinds) or the transformers is too old."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if config is None or not layers:
        raise ValueError(
            "kv_cache='float8' needs transformers >= 4.56 (a cache made of layers, from the model's config); "
            "use kv_cache='model'"
        )
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if kinds:
        raise ValueError(
            f"kv_cache='float8' stores full-attention layers only; this model's cache has {', '.join(kinds)} "
            f"(sliding windows): use kv_cache='model'"
        )
    layer_class = _float8_layer_class()
    cache.layers = [layer_class() for _ in layers]
