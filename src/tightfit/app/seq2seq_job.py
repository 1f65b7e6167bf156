"""``tightfit run`` on an encoder-decoder (T5, BART): the prompt is the encoder's input, and
the decoder generates greedily from its start token. Planned as the encoder's forward and
the first decoder step (the cross-attention's cache made there), with the decoder's
self-attention cache growing over the one-token steps after it as a reservation of the
plan; quality is the token agreement with full precision, teacher-forced."""

from __future__ import annotations

import torch

from tightfit._format import human_bytes
from tightfit.app import kv_cache
from tightfit.app.generation import Generation, decoder_start, generate_seq2seq, seq2seq_agreement
from tightfit.app.generation_job import GenerationJob
from tightfit.kinds import ENCODER_DECODER

__all__ = ["Seq2SeqJob"]


class Seq2SeqJob(GenerationJob):
    """Generates ``max_new_tokens`` greedily from the prompt as the encoder's input; the
    decoder's cache in the model's dtype, decoded eagerly (a captured decode is a causal LM's
    for now)."""

    kind = ENCODER_DECODER
    kv_format = "model"

    def call(self) -> Generation:
        return generate_seq2seq(self.model, self.input_ids, self.max_new_tokens, self.synchronize)

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """The encoder's forward and the first decoder step: what the first token costs."""
        return {"input_ids": self.input_ids, "decoder_input_ids": decoder_start(self.model, self.input_ids.device)}

    def kv_cache_bytes(self) -> int:
        """The decoder's self-attention cache growing over the one-token steps after the first."""
        return (self.max_new_tokens - 1) * kv_cache.bytes_per_token(self.model.config, self.dtype)

    def covers(self) -> str:
        return (
            f"the encoder over the {self.input_ids.shape[1]}-token prompt and the first decoder step, plus the "
            f"decoder's self-attention cache growing over the {self.max_new_tokens - 1} one-token decode forwards "
            f"({human_bytes(self.kv_cache_bytes())}); {kv_cache.describe('model', self.model.config, self.dtype)}"
        )

    def _agreement(self, reference: tuple[int, ...]) -> float:
        return seq2seq_agreement(self.model, self.input_ids, reference)
