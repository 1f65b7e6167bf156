"""Greedy text generation for ``tightfit run`` on causal LMs, timed by phase, and the token
agreement that tells how much a change of the weights changed what the model says."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch

from tightfit._validate import check_type
from tightfit.app import captured
from tightfit.app.kv_cache import cache_argument, cache_keyword, returned_cache
from tightfit.memory import mark

__all__ = [
    "Generation",
    "generate_greedy",
    "generate_seq2seq",
    "next_token",
    "prefill_inputs",
    "seq2seq_agreement",
    "token_agreement",
]


@dataclass(frozen=True)
class Generation:
    """The new tokens of one greedy generation and how long its two phases took.

    ``prefill_seconds``: the prompt's forward up to the first new token (time to first
    token); ``decode_seconds``: the one-token forwards of the other new tokens.
    """

    tokens: tuple[int, ...]
    prefill_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float | None:
        """New tokens after the first, per second of decoding; None for a single new token."""
        if len(self.tokens) < 2 or self.decode_seconds <= 0:
            return None
        return (len(self.tokens) - 1) / self.decode_seconds


def _check_ids(input_ids: Any) -> None:
    check_type("input_ids", input_ids, torch.Tensor)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1 or input_ids.dtype != torch.long:
        raise ValueError(
            f"input_ids must be a (1, n >= 1) int64 tensor, got shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}"
        )


def _check_new_tokens(max_new_tokens: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def next_token(output: Any) -> torch.Tensor:
    """The greedy next token of a forward (the last position's logits); the rest of
    ``output`` is dropped here, not held while decoding."""
    return output.logits[:, -1].argmax(-1, keepdim=True)


def prefill_inputs(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The prefill's inputs: the prompt and, where the model's forward takes it,
    ``logits_to_keep`` naming the last position (a tensor, as a plan's example inputs must
    be), so that the logits over the vocabulary are made for the one position the next
    token needs, not for the whole prompt: for a large vocabulary and a long prompt, what
    would dominate the prefill's peak."""
    inputs = {"input_ids": input_ids}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        inputs["logits_to_keep"] = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
    return inputs


@torch.inference_mode()
def generate_greedy(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    synchronize: Any = None,
    graph: bool = False,
    kv_format: str = "model",
) -> Generation:
    """Generate exactly ``max_new_tokens`` tokens greedily with the model's KV cache.

    An end-of-sequence token does not stop it, so that every run decodes as many tokens
    and their speeds compare. ``synchronize`` (a no-argument callable) waits for the device
    before each clock reading; ``memory.mark`` labels the two phases on a recorded timeline.
    ``graph``: decode by replaying one captured CUDA graph of the step (a static KV cache;
    every weight on the device; see :mod:`tightfit.app.captured`). ``kv_format``: the KV
    cache's format (:mod:`tightfit.app.kv_cache`; the graph's static cache is the model's).
    """
    _check_ids(input_ids)
    _check_new_tokens(max_new_tokens)
    if synchronize is not None and not callable(synchronize):
        raise TypeError(
            f"synchronize must be None or a callable taking no argument, got "
            f"{type(synchronize).__name__}: {synchronize!r}"
        )
    check_type("graph", graph, bool)
    if graph and kv_format != "model":
        raise ValueError(
            f"kv_format={kv_format!r} with graph=True: a captured decode keeps a static cache in the model's dtype"
        )
    wait = synchronize or (lambda: None)
    if graph:
        captured.check_capturable(model, input_ids)
        if max_new_tokens > 1:
            tokens, prefill_seconds, decode_seconds = captured.decode(model, input_ids, max_new_tokens, wait)
            return Generation(tuple(tokens), prefill_seconds, decode_seconds)
    mark("prefill")
    start = time.perf_counter()
    cache = cache_argument(model, kv_format)
    token = next_token(model(**prefill_inputs(model, input_ids), use_cache=True, **cache))
    tokens = [int(token)]
    wait()
    prefilled = time.perf_counter()
    mark("decode")
    for _ in range(max_new_tokens - 1):
        token = next_token(model(input_ids=token, use_cache=True, **cache))
        tokens.append(int(token))
    wait()
    return Generation(tuple(tokens), prefilled - start, time.perf_counter() - prefilled)


@torch.inference_mode()
def token_agreement(model: Any, input_ids: torch.Tensor, reference: tuple[int, ...]) -> float:
    """Fraction of positions where ``model``'s greedy next token matches ``reference``.

    Teacher forcing: one forward over the prompt and the reference continuation, so that a
    single early difference does not derail the rest. ``reference`` is what the model
    generated at full precision; 1.0 means every next-token choice was kept.
    """
    _check_ids(input_ids)
    check_type("reference", reference, tuple)
    if not reference or not all(isinstance(t, int) and not isinstance(t, bool) for t in reference):
        raise ValueError(f"reference must be a non-empty tuple of token ids, got {reference!r}")
    continuation = torch.tensor([reference[:-1]], dtype=torch.long, device=input_ids.device)
    logits = model(input_ids=torch.cat([input_ids, continuation], dim=1), use_cache=False).logits
    predicted = logits[0, input_ids.shape[1] - 1 :].argmax(-1).cpu()
    return float((predicted == torch.tensor(reference)).float().mean())


def decoder_start(model: Any, device: torch.device) -> torch.Tensor:
    """An encoder-decoder's first decoder input: its ``decoder_start_token_id``, (1, 1)."""
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise ValueError(
            f"the model's config names no decoder_start_token_id (got {start!r}); an encoder-decoder needs one"
        )
    return torch.full((1, 1), start, dtype=torch.long, device=device)


@torch.inference_mode()
def generate_seq2seq(model: Any, input_ids: torch.Tensor, max_new_tokens: int, synchronize: Any = None) -> Generation:
    """Generate exactly ``max_new_tokens`` tokens greedily with an encoder-decoder: the
    encoder once over the input, then the decoder one token at a time with its cache (the
    cross-attention's keys and values made at the first step, the self-attention's growing).
    The first phase (time to first token) is the encoder and the first decoder step."""
    _check_ids(input_ids)
    _check_new_tokens(max_new_tokens)
    wait = synchronize or (lambda: None)
    keyword = cache_keyword(model)
    mark("prefill")
    start = time.perf_counter()
    encoded = model.get_encoder()(input_ids=input_ids)
    output = model(encoder_outputs=encoded, decoder_input_ids=decoder_start(model, input_ids.device), use_cache=True)
    cache = returned_cache(output)
    token = next_token(output)
    del output
    tokens = [int(token)]
    wait()
    prefilled = time.perf_counter()
    mark("decode")
    for _ in range(max_new_tokens - 1):
        token = next_token(model(encoder_outputs=encoded, decoder_input_ids=token, use_cache=True, **{keyword: cache}))
        tokens.append(int(token))
    wait()
    return Generation(tuple(tokens), prefilled - start, time.perf_counter() - prefilled)


@torch.inference_mode()
def seq2seq_agreement(model: Any, input_ids: torch.Tensor, reference: tuple[int, ...]) -> float:
    """:func:`token_agreement` for an encoder-decoder: one forward, the decoder teacher-forced
    on the start token and ``reference``'s tokens but the last."""
    _check_ids(input_ids)
    if not reference or not all(isinstance(t, int) and not isinstance(t, bool) for t in reference):
        raise ValueError(f"reference must be a non-empty tuple of token ids, got {reference!r}")
    forced = torch.tensor([reference[:-1]], dtype=torch.long, device=input_ids.device)
    decoder_ids = torch.cat([decoder_start(model, input_ids.device), forced], dim=1)
    predicted = model(input_ids=input_ids, decoder_input_ids=decoder_ids, use_cache=False).logits[0].argmax(-1).cpu()
    return float((predicted == torch.tensor(reference)).float().mean())
