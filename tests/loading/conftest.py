"""What the loading tests share: one tiny causal LM folder per test module."""

from __future__ import annotations

import pytest

from tightfit.app.models import save_causal_lm
from zoo.lm import TINY_CAUSAL_LM


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("tiny-llama"), **TINY_CAUSAL_LM)
