"""The Python examples in the README and the docs pages run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "README.md",
    "docs/ops.md",
    "docs/quantization.md",
    "docs/hooks.md",
    "docs/hints.md",
    "docs/compile.md",
    "docs/memory.md",
    "docs/fit.md",
    "docs/load.md",
    "docs/checkpoints.md",
    "docs/migrating.md",
    "docs/architecture.md",
]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run(page, capsys):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no python example"
    torch._dynamo.reset()  # each page is a fresh session: no page sees another's compiled frames
    for block in blocks:
        # "<page>", not the page's path: dynamo tokenizes the file a frame names (for its
        # source lines), and a Markdown page need not tokenize as Python
        exec(compile(block, f"<{page}>", "exec"), {})
    assert capsys.readouterr().out  # the examples print what they show
