"""LoRA adapters beside frozen Linear layers: the shape of a QLoRA fine-tune. The base
stays an ``nn.Linear`` leaf (``<name>.base``), so the fit planner may store it compactly
(NF4, 8-bit) while the adapters train in full precision beside it. The layout and
initialization are PEFT's: ``lora_A`` drawn as ``nn.Linear`` draws it, ``lora_B`` zero, so
the adapted model starts equal to the base."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from tightfit._validate import check_count, check_type
from tightfit.quant.layers import layer_stack

__all__ = ["LoRALinear", "add_lora"]


class LoRALinear(nn.Module):
    """``base(x) + lora_B(lora_A(x)) * alpha / rank``, ``base`` frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **factory)
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, targets: str | None = None) -> list[str]:
    """Freeze ``model`` and put a rank-``rank`` adapter beside each ``nn.Linear`` of its layer
    stack (or each whose qualified name the regex ``targets`` searches), in place; returns
    the names adapted. Only the adapters require grad afterwards. Layers adapted already
    (and their parts) are left as they are; ``model`` itself is never replaced."""
    check_type("model", model, nn.Module)
    check_count("rank", rank, least=1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    chosen = _chooser(model, targets)
    adapted = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, LoRALinear))
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name and not name.startswith(adapted) and chosen(name)
    ]
    if not names:
        where = f"whose name {targets!r} finds" if targets is not None else "in its layer stack"
        again = " (those adapted already are left as they are)" if adapted else ""
        raise ValueError(f"{type(model).__name__} has no nn.Linear {where} to adapt{again}")
    model.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, LoRALinear(getattr(owner, child), rank, alpha))
    return names


def _chooser(model: nn.Module, targets: str | None) -> Callable[[str], bool]:
    """Whether a Linear's qualified name is one to adapt: ``targets`` finds it, or it is in the layer stack."""
    if targets is None:
        prefixes = tuple(f"{layer}." for layer in layer_stack(model))
        return lambda name: name.startswith(prefixes)
    check_type("targets", targets, str)
    try:
        pattern = re.compile(targets)
    except re.error as error:
        raise ValueError(f"targets={targets!r} is not a regular expression: {error}") from None
    return lambda name: pattern.search(name) is not None
