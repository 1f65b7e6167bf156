"""Small models and injected time-model figures for the fit planner's tests."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from tightfit.fitting import Calibration

#: A Llama-style causal LM small enough to save, load and run in well under a second
#: (``tightfit.app.models.save_causal_lm(path, **TINY_CAUSAL_LM)``).
TINY_CAUSAL_LM = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


#: The docs' calibration: figures measured once on the pages' machine (docs/fit.md).
DOCS_CALIBRATION = Path(__file__).resolve().parents[2] / "docs" / "examples" / "calibration-cpu.json"


def cache_docs_calibration() -> None:
    """Put the docs' calibration in ``$TIGHTFIT_CACHE_DIR`` under this machine's name and
    torch, so that plans read it instead of measuring this CPU (and come out the same on
    every machine)."""
    from tightfit.fitting.calibration import _device_name, cache_path

    for threads in range(1, (os.cpu_count() or 1) + 1):  # child processes may run fewer threads (torchrun's ranks)
        figures = json.loads(DOCS_CALIBRATION.read_text())
        figures.update(device_name=_device_name(torch.device("cpu"), threads), torch_version=torch.__version__)
        path = cache_path("cpu", figures["device_name"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures))


def figures(**changes) -> Calibration:
    """Deterministic figures (``Calibration.fixed``): 10 GFLOP/s, 10 GB/s memory, 1 GB/s
    disk, decoding free unless changed."""
    return Calibration.fixed(**{"device_name": "test", **changes})


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """An embedding, a stack of blocks, a head: the shape of a language model."""

    def __init__(self, vocab: int = 2000, width: int = 128, hidden: int = 512, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, 64)

    def forward(self, input_ids: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        if scale is not None:
            x = x * scale
        return self.head(x)


def tiny_lm(seed: int = 0, **sizes) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**sizes).eval()


def token_ids(batch: int = 4, length: int = 16, vocab: int = 2000) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def resaved_in_bfloat16(folder: Path, path: Path, config_dtype: str | None = None) -> Path:
    """``folder``'s causal LM saved in bfloat16 into ``path``, its config naming
    ``config_dtype`` (None: no dtype), so the stored dtype differs from the config's."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path)
    for file in folder.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, path / file.name)
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if config_dtype is not None:
        config["dtype"] = config_dtype
    (path / "config.json").write_text(json.dumps(config))
    return path
