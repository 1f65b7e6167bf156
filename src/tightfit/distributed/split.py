"""Cutting a Hugging Face model into pipeline stages: each stage is the model itself, its
layer stack cut down to a contiguous range, the embedding kept only by the first stage and
the final norm and head only by the last, so that every tool made for a whole model (the
fit, the streaming load, the KV cache, the measurement) serves a stage unchanged.

Why the model's own class and not a wrapper: its forward builds the attention mask, the
rotary embedding and the cache positions as the whole model does, and its parameters keep
the checkpoint's names (``model.layers.5.mlp...``), so a stage streams exactly its own
tensors from the checkpoint and nothing else. A stage after the first takes the hidden
states the stage before sent as ``inputs_embeds``; a stage before the last returns its
hidden states where the whole model returns logits (its head is an identity).

Two families are cut: decoder-only causal LMs laid out as Llama is (``model.layers``,
``model.embed_tokens``, ``model.norm``, ``lm_head``) and BERT-style encoders
(``embeddings``, ``encoder.layer``, ``pooler``), of the model types in
:data:`CUT_MODEL_TYPES`, whose stages were checked against the whole model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tightfit._validate import check_count, check_type
from tightfit.kinds import CAUSAL_LM, ENCODER

__all__ = ["CUT_MODEL_TYPES", "Layout", "check_kind", "cut", "layout_of"]


@dataclass(frozen=True)
class Layout:
    """Where a model keeps its stack: ``stack`` (the ModuleList of layers), ``first``
    (modules only the first stage runs), ``last`` (only the last) and ``config`` (the
    config object whose ``num_hidden_layers`` the forward reads), all by qualified name."""

    kind: str
    stack: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    config: tuple[str, ...]

    def layers(self, model: nn.Module) -> int:
        return len(model.get_submodule(self.stack))


_DECODER = Layout(CAUSAL_LM, "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), ("", "model"))
_ENCODER = Layout(ENCODER, "encoder.layer", ("embeddings",), (), ("",))
_LAYOUTS = {CAUSAL_LM: _DECODER, ENCODER: _ENCODER}

#: The model types whose cut stages compute what the whole model computes (checked: chained
#: stages against the whole model, on this transformers). Others may change values between
#: the parts a stage keeps (Granite scales the embeddings in the model's forward, Gemma 2
#: soft-caps the logits, which a stage before the last would apply to its hidden states).
CUT_MODEL_TYPES = {CAUSAL_LM: ("gemma", "llama", "mistral", "qwen2", "qwen3"), ENCODER: ("bert", "roberta")}


def check_kind(kind: str) -> str:
    """``kind``, where stages can be cut for it; a ValueError naming the kinds that can."""
    if kind not in _LAYOUTS:
        raise ValueError(f"kind={kind!r} cannot be cut into stages; accepted: {', '.join(map(repr, _LAYOUTS))}")
    return kind


def layout_of(model: nn.Module, kind: str) -> Layout:
    """The :class:`Layout` of ``model`` run as ``kind``; a ValueError naming what is missing
    where the model is laid out otherwise (it cannot be cut into stages)."""
    check_type("model", model, nn.Module)
    layout = _LAYOUTS[check_kind(kind)]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in CUT_MODEL_TYPES[kind]:
        raise ValueError(
            f"{type(model).__name__} (model_type {model_type!r}) is not one whose stages are known to compute what the "
            f"whole model computes; accepted for a {kind}: {', '.join(CUT_MODEL_TYPES[kind])}"
        )
    names = dict(model.named_modules())
    missing = [name for name in (layout.stack, *layout.first, *layout.last) if name not in names]
    if missing or not isinstance(names.get(layout.stack), nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} is not laid out as stages are cut ({kind}: a ModuleList {layout.stack!r} and "
            f"{', '.join(layout.first + layout.last)}); it lacks {', '.join(missing) or layout.stack + ' as a ModuleList'}"
        )
    return layout


class _Received(nn.Module):
    """An encoder's embeddings on a stage after the first: the hidden states received are
    the embedding output already."""

    def forward(self, inputs_embeds: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        return inputs_embeds


class _Kept(nn.ModuleList):
    """The stage's layers under their places in the whole stack (``"5"``, ``"6"``), so
    that their parameters keep the checkpoint's names; iterated and sliced as a list."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        for place, layer in layers.items():
            self.add_module(place, layer)

    def __getitem__(self, index: Any) -> Any:
        values = list(self._modules.values())
        if isinstance(index, slice):
            return nn.ModuleList(values[index])
        return values[index]


def _set(model: nn.Module, name: str, module: nn.Module | None) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attribute, module)


def cut(model: nn.Module, kind: str, start: int, end: int) -> nn.Module:
    """``model`` (changed in place, and returned) cut to the stage holding layers
    ``[start, end)`` of its stack: the first stage keeps the embedding, the last the final
    norm and head; the configs it reads say ``end - start`` layers (copies: the original
    config objects are left as they are) and each attention's ``layer_idx`` is its place
    in the stage, so that the stage's KV cache holds its own layers only. A stage before
    the last returns its hidden states as its logits (its head an identity)."""
    layout = layout_of(model, kind)
    total = layout.layers(model)
    check_count("start", start)
    check_count("end", end, least=1)
    if not start < end <= total:
        raise ValueError(f"layers [start, end) = [{start}, {end}) is not a range of the {total} layers of the stack")
    stack = model.get_submodule(layout.stack)
    kept = {str(place): stack[place] for place in range(start, end)}
    for index, layer in enumerate(kept.values()):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = index
    _set(model, layout.stack, _Kept(kept))
    first, last = start == 0, end == total
    if not first:
        tied_to_head = last and getattr(model.config, "tie_word_embeddings", False)
        for name in layout.first:
            # an encoder's embeddings pass the received states on; a decoder's embedding is
            # skipped by inputs_embeds, and kept only where the head shares its weight
            _set(model, name, _Received() if kind == ENCODER else (model.get_submodule(name) if tied_to_head else None))
    if not last:
        for name in layout.last:
            _set(model, name, nn.Identity())
        if kind == ENCODER and getattr(model, "pooler", None) is not None:
            model.pooler = None
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = end - start
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[start:end]
    for name in layout.config:
        (model.get_submodule(name) if name else model).config = config
    return model
