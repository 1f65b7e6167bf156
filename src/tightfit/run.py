"""The main job behind ``tightfit run``: load a model, pick a backend, optionally make its
weights compact (quantization, float8 storage) or move them off the device (offloading),
run it, and report latency and memory measured on the device. Later stages (budgets and
plans) extend :class:`RunOptions` and :class:`RunReport`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tightfit import backends
from tightfit._validate import check_type
from tightfit.hooks import STORAGES, apply_layerwise_casting, apply_offloading, resident_bytes
from tightfit.memory import Measurement, measure, tensor_bytes
from tightfit.models import default_model_dir, embed, load_encoder
from tightfit.quant import Blockwise8Config, FP4Config, Int8Config, Linear8bit, NF4Config, QuantConfig, QuantState, layer_stack, quantize_

__all__ = ["DEFAULT_SENTENCES", "QUANT_CONFIGS", "STORAGE_DTYPES", "RunOptions", "RunReport", "run", "weights_bytes"]

#: ``--quant`` choices and the config each applies to every ``nn.Linear``; with ``keep_8bit``
#: the 4-bit ones (nf4, fp4) store the later half of the model's layer stack in 8 bits.
QUANT_CONFIGS: dict[str, QuantConfig] = {
    "nf4": NF4Config(),
    "fp4": FP4Config(),
    "int8": Int8Config(),
    "8bit": Blockwise8Config(),
}

#: ``--storage-dtype`` choices: layerwise casting stores weights so and computes in the model's dtype.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

DEFAULT_SENTENCES: tuple[str, ...] = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A woman is holding an infant in her arms.",
    "A man is riding a horse.",
    "Someone on horseback rides across a field.",
    "The new movie is awesome.",
    "The film was a great success with critics.",
)


@dataclass(frozen=True)
class RunOptions:
    """What to run. ``model`` None means the built-in default; ``backend`` None the default backend.

    ``keep_8bit`` (with a 4-bit ``quant``): the Linear layers of the later half of the
    model's layer stack (:func:`tightfit.quant.layer_stack`) are stored in blockwise 8-bit,
    the rest in 4 bits; False stores every Linear layer in 4 bits.
    """

    model: str | None = None
    backend: str | None = None
    quant: str | None = None
    storage_dtype: str | None = None
    offload: str | None = None
    repeat: int = 5
    sentences: tuple[str, ...] = DEFAULT_SENTENCES
    top_pairs: int = 3
    keep_8bit: bool = True

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, Path)):
            raise TypeError(f"model must be a folder path or None, got {type(self.model).__name__}: {self.model!r}")
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str or None, got {type(self.backend).__name__}: {self.backend!r}")
        if self.quant is not None and self.quant not in QUANT_CONFIGS:
            raise ValueError(f"quant={self.quant!r} is not accepted; accepted: {', '.join(QUANT_CONFIGS)} or None")
        if self.storage_dtype is not None and self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype={self.storage_dtype!r} is not accepted; accepted: {', '.join(STORAGE_DTYPES)} or None")
        if self.quant is not None and self.storage_dtype is not None:
            raise ValueError("quant and storage_dtype both change how weights are stored; choose one")
        if self.offload is not None and self.offload not in STORAGES:
            raise ValueError(f"offload={self.offload!r} is not accepted; accepted: {', '.join(STORAGES)} or None")
        for name in ("repeat", "top_pairs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.keep_8bit, bool):
            raise TypeError(f"keep_8bit must be a bool, got {type(self.keep_8bit).__name__}: {self.keep_8bit!r}")
        if not isinstance(self.sentences, tuple) or len(self.sentences) < 2 or not all(isinstance(s, str) and s.strip() for s in self.sentences):
            raise ValueError("sentences must be a tuple of at least two non-empty strings")


@dataclass
class RunReport:
    """What a run measured."""

    model: str
    backend: str
    device: str
    weights_bytes: int
    embedding_dim: int
    measurement: Measurement
    pairs: list[tuple[str, str, float]] = field(default_factory=list)
    quant: str | None = None
    full_weights_bytes: int | None = None  # before quantization, casting or offloading
    min_cosine_to_full: float | None = None  # embeddings after those against before
    kept_8bit: tuple[str, ...] = ()  # layers a 4-bit quant stored in 8 bits instead
    kept_8bit_linears: int = 0  # how many Linear layers those hold
    kept_8bit_bytes: int = 0  # what they take, stored in 8 bits
    storage_dtype: str | None = None
    offload: str | None = None
    device_weights_bytes: int | None = None  # held in the device's memory between forwards

    @property
    def changes(self) -> str | None:
        """What was done to the weights, for labels: ``nf4``, ``float8_e4m3fn + offload disk``."""
        parts = [self.quant or self.storage_dtype, f"offload {self.offload}" if self.offload else None]
        return " + ".join(p for p in parts if p) or None


def _most_similar(embeddings: torch.Tensor, sentences: tuple[str, ...], count: int) -> list[tuple[str, str, float]]:
    scores = embeddings @ embeddings.T
    rows, cols = torch.triu_indices(len(sentences), len(sentences), offset=1)
    values = scores[rows, cols]
    order = values.argsort(descending=True)[:count]
    return [(sentences[int(rows[i])], sentences[int(cols[i])], float(values[i])) for i in order]


def run(options: RunOptions | None = None) -> RunReport:
    """Run the main job and return its report."""
    options = options or RunOptions()
    if not isinstance(options, RunOptions):
        raise TypeError(f"options must be RunOptions, got {type(options).__name__}")
    backend = backends.get(options.backend) if options.backend else backends.default()
    device = backend.resolve_device(options.backend if options.backend and ":" in options.backend else None)
    folder = Path(options.model) if options.model is not None else default_model_dir()
    model, tokenizer = load_encoder(folder, device)
    sentences = list(options.sentences)
    full_weights = reference = None
    kept: tuple[str, ...] = ()
    kept_linears: list[torch.nn.Module] = []
    if options.quant or options.storage_dtype or options.offload:
        full_weights = weights_bytes([model])
        reference = embed(model, tokenizer, sentences, device).cpu()
    if options.quant is not None:
        config = QUANT_CONFIGS[options.quant]
        if options.keep_8bit and isinstance(config, NF4Config):
            stack = layer_stack(model)
            kept = stack[len(stack) // 2:]
            config = replace(config, keep_8bit=kept)
        quantize_(model, config)
        kept_linears = [module for name in kept for module in model.get_submodule(name).modules() if isinstance(module, Linear8bit)]
    if options.storage_dtype is not None:
        compute_dtype = next(model.parameters()).dtype
        apply_layerwise_casting(model, STORAGE_DTYPES[options.storage_dtype], compute_dtype)
    if options.offload is not None:
        apply_offloading(model, device, storage=options.offload)
    weights = weights_bytes([model])
    on_device = resident_bytes(model, device) if options.offload else weights
    measurement = measure(lambda: embed(model, tokenizer, sentences, device), device, repeat=options.repeat, baseline_bytes=on_device)
    embeddings = embed(model, tokenizer, sentences, device).cpu()
    return RunReport(
        model=str(folder) if options.model is not None else "all-MiniLM-L6-v2 (built-in default)",
        backend=backend.name,
        device=str(device),
        weights_bytes=weights,
        embedding_dim=int(embeddings.shape[-1]),
        measurement=measurement,
        pairs=_most_similar(embeddings, options.sentences, options.top_pairs),
        quant=options.quant,
        full_weights_bytes=full_weights,
        min_cosine_to_full=None if reference is None else float((embeddings * reference).sum(-1).min()),
        kept_8bit=kept,
        kept_8bit_linears=len(kept_linears),
        kept_8bit_bytes=weights_bytes(kept_linears),
        storage_dtype=options.storage_dtype,
        offload=options.offload,
        device_weights_bytes=on_device,
    )


def weights_bytes(modules: list[torch.nn.Module]) -> int:
    """The weights' bytes that ``tightfit run`` reports: parameters and buffers of ``modules``,
    plus the scales of quantized layers (a QuantState is neither); a tensor they share counts once."""
    check_type("modules", modules, (list, tuple))
    for index, module in enumerate(modules):
        check_type(f"modules[{index}]", module, torch.nn.Module)
    tensors = []
    for root in modules:
        tensors += list(root.parameters()) + list(root.buffers())
        for module in root.modules():
            state = getattr(module, "quant_state", None)
            if isinstance(state, QuantState):
                tensors += state.tensors()
    return tensor_bytes(tensors)
