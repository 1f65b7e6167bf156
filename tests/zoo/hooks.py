"""Small models the hook tests share (the hook tests and the fit tests)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
from torch import nn


class Block(nn.Module):
    """LayerNorm, Linear up 4x, GELU, Linear down, residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def stack(width: int = 32, depth: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width) for _ in range(depth)]).eval()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().float(), expected.detach().float()
    return float((got - expected).norm() / expected.norm())


def cosine(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float(
        torch.nn.functional.cosine_similarity(
            got.detach().flatten().float(), expected.detach().flatten().float(), dim=0
        )
    )


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def same_state(module: nn.Module, saved: dict[str, torch.Tensor]) -> bool:
    """Same keys, dtypes, devices and bits."""
    now = module.state_dict()
    return sorted(now) == sorted(saved) and all(
        now[k].dtype == saved[k].dtype and now[k].device == saved[k].device and torch.equal(now[k], saved[k])
        for k in saved
    )


def bert(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    return transformers.BertModel(config).eval()


def bert_and_output(seed: int = 0):
    """A BERT built from a config, token ids, and its output for them (no grad)."""
    pytest.importorskip("transformers")
    model = bert(seed)
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
    return model, ids, expected


def unet(seed: int = 0):
    import diffusers

    torch.manual_seed(seed)
    return diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(32, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    ).eval()


def held_files(pid: int, folder: Path) -> set[str]:
    """The distinct files in ``folder`` that process ``pid`` holds open (Linux; unnamed ones end in '(deleted)')."""
    links = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            links.add(os.readlink(fd))
    return {link for link in links if link.startswith(f"{folder}/")}
