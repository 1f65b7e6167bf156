"""Greedy decoding replayed from one captured device graph (CUDA graphs).

On a GPU a decoding step of a small model is hundreds of kernel launches, each costing more
host time (Python, argument checks, dispatch) than its kernel takes on the device: a 1.1B
model decodes at tens of tokens a second where its bytes allow hundreds. Captured once, the
step's launches replay with no host work. What capture needs: every tensor the step reads
at a fixed address (a static KV cache sized for the whole generation; the token and its
position in device buffers the step itself updates), no host-device synchronization
inside the step, and every weight resident on the device (an offloading hook's copies
would be frozen into the graph).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

__all__: list[str] = []

#: Steps run before capture, on a side stream: kernels compile, lazy buffers and library
#: workspaces are allocated outside the graph.
WARMUP_STEPS = 2


def check_capturable(model: Any, input_ids: torch.Tensor) -> None:
    """Raise ValueError naming why this model and input cannot be decoded from a CUDA graph."""
    device = input_ids.device
    if device.type != "cuda":
        raise ValueError(f"graph=True needs input_ids on a CUDA device (CUDA graphs); input_ids is on {device}")
    off = sorted({str(t.device) for t in [*model.parameters(), *model.buffers()] if t.device != device})
    if off:
        raise ValueError(
            f"graph=True needs every weight on {device}; some are on {', '.join(off)} "
            "(offloaded weights move during the forward, which a graph cannot replay)"
        )


def _static_cache(model: Any, length: int) -> dict[str, Any]:
    """A static KV cache for ``length`` positions, as the keyword the model's forward takes."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    parameters = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in parameters else "past_key_values": cache}


def replayer(warmup: Callable[[], None], step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` captured as a CUDA graph after ``warmup`` (the same step on a scratch cache)
    ran on a side stream; its ``replay``."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            warmup()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as error:
        raise RuntimeError(
            f"capturing the decoding step as a CUDA graph failed ({' '.join(str(error).split())[:200]}); a captured "
            "step must not wait for the device (a hook that synchronizes, .item(), a branch on a tensor's value): "
            "decode with graph=False"
        ) from error
    return graph.replay


def decode(model: Any, input_ids: torch.Tensor, max_new_tokens: int, wait) -> tuple[list[int], float, float]:
    """(new tokens, seconds to the first, seconds of the rest): the prompt's forward eagerly,
    then each step a replay of the captured one. Warm-up and capture count in the first
    token's time, since the caller waits for them."""
    device = input_ids.device
    prompt = input_ids.shape[1]
    start = time.perf_counter()
    length = prompt + max_new_tokens
    cache = _static_cache(model, length)
    positions = torch.arange(prompt, device=device)
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    logits = model(input_ids=input_ids, cache_position=positions, use_cache=True, **cache, **last).logits
    first = logits[:, -1].argmax(-1, keepdim=True)
    del logits
    token, position = first.clone(), torch.full((1,), prompt, dtype=torch.long, device=device)
    generated = torch.zeros(max_new_tokens + WARMUP_STEPS, dtype=torch.long, device=device)
    generated[0] = first[0, 0]

    def step_on(cache: dict[str, Any]) -> Callable[[], None]:
        def step() -> None:
            out = model(input_ids=token, cache_position=position, use_cache=True, **cache).logits
            token.copy_(out[:, -1].argmax(-1, keepdim=True))
            generated.index_copy_(0, position - (prompt - 1), token.view(1))
            position.add_(1)

        return step

    # The warm-up runs on a scratch cache: a cache keeps state of its own (transformers'
    # static layers count what they hold), which warm-up steps on the real one would advance.
    replay = replayer(step_on(_static_cache(model, length)), step_on(cache), device)
    token.copy_(first)
    position.fill_(prompt)
    wait()
    prefilled = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        replay()
    wait()
    tokens = generated[:max_new_tokens].tolist()
    return tokens, prefilled - start, time.perf_counter() - prefilled
