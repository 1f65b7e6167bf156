"""Greedy generation, timed the same way for every decode benchmark (``decode_cpu.py``,
``decode.py``): tightfit's own loop (what ``tightfit run`` times) and transformers'
``generate``, each returning its tokens and the prefill's and decode's seconds.
Not a benchmark itself, and not public API: a module the scripts next to it import.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from _common import module_bytes
from torch import nn

from tightfit.app.generation import generate_greedy
from tightfit.quant import LinearInt8, QuantizedLinear


@dataclass
class Generated:
    """One generation: its new tokens, the prefill's and the decode's seconds, and the
    seconds of each one-token forward of the decode (``step_seconds``)."""

    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    step_seconds: list[float] = field(default_factory=list)


def linear_bytes(model: nn.Module, kinds: tuple[type, ...] = ()) -> int:
    """Stored bytes of every Linear layer (quantized or cast ones as stored, and any of ``kinds``),
    LM head included: what one decode step reads from the weights."""
    linear = (nn.Linear, QuantizedLinear, LinearInt8, *kinds)
    return sum(module_bytes(module) for module in model.modules() if isinstance(module, linear))


class TorchRunner:
    """A causal LM in this process, generated with ``tightfit.app.generation.generate_greedy``
    (what ``tightfit run`` times). ``device``: where the prompt's ids go; ``synchronize``
    waits for the device before each clock reading (an accelerator runs behind the host);
    ``graph``: decode from a captured CUDA graph (``generate_greedy(..., graph=True)``)."""

    def __init__(
        self,
        model: nn.Module,
        note: str = "",
        synchronize: Callable[[], None] | None = None,
        bytes_per_token: int | None = None,
        device: torch.device | str = "cpu",
        graph: bool = False,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.graph = graph
        self.bytes_per_token = linear_bytes(model) if bytes_per_token is None else bytes_per_token
        self.note = note
        self.synchronize = synchronize or (lambda: None)
        self.spans: list[list[float]] = []  # [start, end] of each forward, from two hooks on the model
        if not graph:  # a replayed graph runs no hooks, and a hook's synchronize would break its capture
            model.register_forward_pre_hook(lambda *_: self.spans.append([self._now()]))
            model.register_forward_hook(lambda *_: self.spans[-1].append(self._now()))

    def _now(self) -> float:
        self.synchronize()
        return time.perf_counter()

    def _steps(self) -> list[float]:
        """Seconds of each forward after the first (the prefill) since the last call."""
        steps = [end - start for start, end in self.spans[1:]]
        self.spans.clear()
        return steps

    def generate(self, ids: list[int], new_tokens: int) -> Generated:
        self.spans.clear()
        input_ids = torch.tensor([ids], device=self.device)
        result = generate_greedy(self.model, input_ids, new_tokens, synchronize=self.synchronize, graph=self.graph)
        return Generated(list(result.tokens), result.prefill_seconds, result.decode_seconds, self._steps())

    def close(self) -> None:
        self.model = None


class TransformersRunner(TorchRunner):
    """``model.generate`` (greedy), timed by a streamer at each new token."""

    def generate(self, ids: list[int], new_tokens: int) -> Generated:
        from transformers.generation.streamers import BaseStreamer

        runner = self

        class Clock(BaseStreamer):
            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value) -> None:  # first the prompt, then each new token
                self.times.append(runner._now())

            def end(self) -> None:
                pass

        clock = Clock()
        self.spans.clear()
        input_ids = torch.tensor([ids], device=self.device)
        start = self._now()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=self.model.config.pad_token_id,
                streamer=clock,
            )
        tokens = output[0, len(ids) :].tolist()
        first, last = clock.times[1], clock.times[-1]
        return Generated(tokens, first - start, last - first, self._steps())
