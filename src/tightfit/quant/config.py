"""Quantization configs and ``quantize_(model, config)``.

Each config is a frozen dataclass validated when built; ``quantize_`` finds the
handler for a config's type in a registry that ``@register_handler`` fills, so a new
format adds a config and a handler without touching ``quantize_``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tightfit._progress import task
from tightfit._validate import check_choice, check_non_negative_number, check_type
from tightfit.ops.blockwise import BLOCKSIZES_4BIT, BLOCKSIZES_8BIT
from tightfit.quant.functional import COMPUTE_CHOICES
from tightfit.quant.modules import Linear4bit, Linear8bit, LinearInt8

__all__ = [
    "Blockwise8Config",
    "FP4Config",
    "Int8Config",
    "NF4Config",
    "QuantConfig",
    "handler_for",
    "quantize_",
    "register_handler",
]


def _check_patterns(name: str, value: object) -> None:
    if isinstance(value, str) or not isinstance(value, tuple) or not all(isinstance(p, str) for p in value):
        raise TypeError(f"{name} must be a tuple of name patterns, got {value!r}")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclass(frozen=True)
class QuantConfig:
    """Options every format shares. ``skip`` holds module-name patterns (fnmatch) left as they are."""

    skip: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        _check_patterns("skip", self.skip)

    def config_for(self, name: str) -> QuantConfig | None:
        """The config that the module with qualified name ``name``, and what it contains,
        gets: None leaves them as they are."""
        return None if _matches(name, self.skip) else self


def _check_blocksize(blocksize: object, accepted: tuple[int, ...]) -> None:
    if isinstance(blocksize, bool) or blocksize not in accepted:
        raise ValueError(f"blocksize={blocksize!r} is not accepted; accepted: {', '.join(map(str, accepted))}")


@dataclass(frozen=True)
class NF4Config(QuantConfig):
    """4-bit NormalFloat weights, the QLoRA format.

    ``keep_8bit`` holds module-name patterns (fnmatch) whose layers are stored in
    blockwise 8-bit (``Blockwise8Config(compute=compute)``: one byte per weight) instead
    of 4 bits: the few that lose most at 4 bits. A pattern may name a container (``"encoder.layer.5"``)
    to keep every layer in it; ``skip`` wins over ``keep_8bit``.

    ``compute`` is how the layers multiply: ``"float"`` (the activations as they come,
    products in float32) or ``"int8"`` (activations quantized to int8 per block of 32 and
    the 4-bit table at int8 levels, integer dot products: faster on CPUs, less exact;
    :func:`tightfit.ops.gemv_4bit_int8`, measured in docs/kernels.md).
    """

    blocksize: int = 64
    double_quant: bool = False
    quant_storage: torch.dtype = torch.uint8
    keep_8bit: tuple[str, ...] = field(default_factory=tuple)
    compute: str = "float"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_blocksize(self.blocksize, BLOCKSIZES_4BIT)
        check_type("double_quant", self.double_quant, bool)
        check_type("quant_storage", self.quant_storage, torch.dtype)
        _check_patterns("keep_8bit", self.keep_8bit)
        check_choice("compute", self.compute, COMPUTE_CHOICES)

    def config_for(self, name: str) -> QuantConfig | None:
        config = super().config_for(name)
        if config is not None and _matches(name, self.keep_8bit):
            return Blockwise8Config(skip=self.skip, compute=self.compute)
        return config


@dataclass(frozen=True)
class FP4Config(NF4Config):
    """4-bit floating-point weights."""


@dataclass(frozen=True)
class Blockwise8Config(QuantConfig):
    """8-bit weights on the dynamic map, one scale per block.

    ``compute``: ``"float"``, or ``"int8"`` (activations quantized to int8 per block of 32,
    the map at int16 levels, integer dot products: faster on CPUs, less exact;
    :func:`tightfit.ops.gemv_blockwise_int8`, measured in docs/kernels.md).
    """

    blocksize: int = 4096
    double_quant: bool = False
    compute: str = "float"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_blocksize(self.blocksize, BLOCKSIZES_8BIT)
        check_type("double_quant", self.double_quant, bool)
        check_choice("compute", self.compute, COMPUTE_CHOICES)


@dataclass(frozen=True)
class Int8Config(QuantConfig):
    """LLM.int8(): int8 weights and activations, outlier columns in full precision."""

    threshold: float = 6.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_non_negative_number("threshold", self.threshold)


_HANDLERS: dict[type, Callable[[nn.Linear, QuantConfig], nn.Module]] = {}


def register_handler(config_type: type) -> Callable:
    """Decorator: ``handler(linear, config) -> module`` quantizes one ``nn.Linear`` for ``config_type``."""
    if not (isinstance(config_type, type) and issubclass(config_type, QuantConfig)):
        raise TypeError(f"config_type must be a QuantConfig subclass, got {config_type!r}")

    def decorate(handler: Callable[[nn.Linear, QuantConfig], nn.Module]) -> Callable:
        _HANDLERS[config_type] = handler
        return handler

    return decorate


@register_handler(NF4Config)
def _nf4(linear: nn.Linear, config: NF4Config) -> nn.Module:
    return Linear4bit.from_linear(
        linear,
        quant_type="nf4",
        blocksize=config.blocksize,
        compress_statistics=config.double_quant,
        quant_storage=config.quant_storage,
        compute=config.compute,
    )


@register_handler(FP4Config)
def _fp4(linear: nn.Linear, config: FP4Config) -> nn.Module:
    return Linear4bit.from_linear(
        linear,
        quant_type="fp4",
        blocksize=config.blocksize,
        compress_statistics=config.double_quant,
        quant_storage=config.quant_storage,
        compute=config.compute,
    )


@register_handler(Blockwise8Config)
def _blockwise8(linear: nn.Linear, config: Blockwise8Config) -> nn.Module:
    return Linear8bit.from_linear(
        linear, blocksize=config.blocksize, nested=config.double_quant, compute=config.compute
    )


@register_handler(Int8Config)
def _int8(linear: nn.Linear, config: Int8Config) -> nn.Module:
    return LinearInt8.from_linear(linear, threshold=config.threshold)


def handler_for(config: QuantConfig) -> Callable[[nn.Linear, QuantConfig], nn.Module]:
    handler = _HANDLERS.get(type(config))
    if handler is None:
        raise ValueError(
            f"no handler is registered for {type(config).__name__}; registered: {', '.join(t.__name__ for t in _HANDLERS)}"
        )
    return handler


def quantize_(model: nn.Module, config: QuantConfig) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by its quantized form; returns ``model``.

    Each module gets ``config.config_for(qualified_name)``, which its children inherit:
    modules matching a pattern in ``config.skip`` stay as they are, and an NF4 / FP4
    config's ``keep_8bit`` patterns get blockwise 8-bit.
    """
    check_type("model", model, nn.Module)
    check_type("config", config, QuantConfig)
    handler_for(config)
    if isinstance(model, nn.Linear):
        raise ValueError(
            "model is itself an nn.Linear; quantize_ replaces children, so wrap it or use Linear4bit.from_linear"
        )
    with task(
        f"quantizing Linear layers ({type(config).__name__})", sum(type(m) is nn.Linear for m in model.modules())
    ) as advance:
        _quantize_children(model, config, prefix="", advance=advance)
    return model


def _quantize_children(module: nn.Module, config: QuantConfig, prefix: str, advance: Callable[[int], None]) -> None:
    # By name, holding no child: named_children() keeps every child it yielded until the
    # loop ends, so each replaced Linear's full-precision weight would stay alive until
    # its siblings are quantized too (a checkpoint streamed in would peak above its plan).
    seen: set[int] = set()  # a module registered twice is quantized once, as named_children() does
    for name in list(module._modules):
        child = module._modules[name]
        if child is None or id(child) in seen:
            continue
        seen.add(id(child))
        qualified = f"{prefix}{name}"
        child_config = config.config_for(qualified)
        if child_config is None:
            continue
        if type(child) is nn.Linear:
            setattr(module, name, handler_for(child_config)(child, child_config))
            advance(1)
        else:
            _quantize_children(child, child_config, prefix=f"{qualified}.", advance=advance)
        del child
