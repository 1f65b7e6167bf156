"""Decoding replayed from a captured CUDA graph (``generate_greedy(..., graph=True)``).

The capture itself needs a CUDA device; the rest (the static cache, the step that updates
its own token and position in device buffers, the reset after the warm-up) runs anywhere.
Here the replayer is replaced by one that runs the warm-up, then the step eagerly, so the
tokens can be compared with the ordinary loop's on the CPU; on a GPU the real capture runs.
"""

from __future__ import annotations

import pytest
import torch

from tightfit.app import captured
from tightfit.app.generation import generate_greedy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _eager_replayer(warmup, step, device):
    for _ in range(captured.WARMUP_STEPS):  # what the real warm-up does, then the step itself
        warmup()
    return step


@pytest.mark.parametrize("new_tokens", [2, 9])
def test_the_static_step_decodes_what_the_loop_decodes(model, monkeypatch, new_tokens):
    ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    expected = generate_greedy(model, ids, new_tokens).tokens
    monkeypatch.setattr(captured, "replayer", _eager_replayer)
    with torch.inference_mode():
        tokens, prefill, decode = captured.decode(model, ids, new_tokens, lambda: None)
    assert tuple(tokens) == expected
    assert prefill > 0 and decode > 0


def test_refusals_name_the_reason(model):
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="graph=True needs input_ids on a CUDA device"):
        generate_greedy(model, ids, 4, graph=True)
    with pytest.raises(TypeError, match="graph must be bool"):
        generate_greedy(model, ids, 4, graph="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_replays_decode_what_the_loop_decodes(model):
    gpu = model.to("cuda")
    ids = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(1)).cuda()
    expected = generate_greedy(gpu, ids, 12).tokens
    assert generate_greedy(gpu, ids, 12, graph=True).tokens == expected
    with pytest.raises(ValueError, match="needs every weight on cuda"):
        generate_greedy(gpu.to("cpu"), ids, 4, graph=True)
