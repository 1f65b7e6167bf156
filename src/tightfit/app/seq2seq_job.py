"""``tightfit run`` on an encoder-decoder (T5, BART): the prompt is the encoder's input, and
the decoder generates greedily from its start token. Planned as the encoder's forward and
the first decoder step (the cross-attention's cache made there), and as the last decoder
step, its self-attention cache at its longest; quality is the token agreement with full
precision, teacher-forced."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tightfit._format import human_bytes
from tightfit.app import kv_cache
from tightfit.app.generation import Generation, decoder_start, generate_seq2seq, next_token, seq2seq_agreement
from tightfit.app.generation_job import GenerationJob
from tightfit.fitting.traced import DECODE, DecodeTrace
from tightfit.kinds import ENCODER_DECODER

if TYPE_CHECKING:
    from tightfit.memory.simulate import Calls

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
        """The decoder's self-attention cache at the last step: a position per new token."""
        return self.max_new_tokens * kv_cache.bytes_per_token(self.model.config, self.dtype)

    def decode_trace(self) -> DecodeTrace | None:
        """The last decoder step: the encoder and a decoder forward over every new token but
        the last fill the caches, then the last token's step, holding what
        :func:`generate_seq2seq` holds between them (the encoder's output, the caches)."""
        if not self.decode_steps():
            return None
        model, prompt, steps = self.model, self.input_ids.shape[1], self.max_new_tokens - 1

        def script(calls: Calls) -> None:
            ids = torch.zeros(1, prompt, dtype=torch.long, device=calls.device)
            start = decoder_start(model, calls.device)
            history = torch.cat([start, torch.zeros(1, steps - 1, dtype=torch.long, device=calls.device)], dim=1)
            output = calls.call(input_ids=ids, decoder_input_ids=history, use_cache=True)
            del ids, start, history
            encoded = (output.encoder_last_hidden_state,)
            cache = kv_cache.returned_cache(output)
            token = next_token(output)
            del output
            calls.phase(DECODE)
            calls.call(
                encoder_outputs=encoded,
                decoder_input_ids=token,
                use_cache=True,
                **{kv_cache.cache_keyword(model): cache},
            )

        return DecodeTrace(script, self.max_new_tokens, "model", self.kv_cache_bytes())

    def covers(self) -> str:
        return (
            f"the encoder over the {self.input_ids.shape[1]}-token prompt and the first decoder step, and the last of "
            f"the {self.max_new_tokens - 1} one-token decode forwards, its self-attention cache at "
            f"{self.max_new_tokens} positions ({human_bytes(self.kv_cache_bytes())}); "
            f"{kv_cache.describe('model', self.model.config, self.dtype)}"
        )

    def _agreement(self, reference: tuple[int, ...]) -> float:
        return seq2seq_agreement(self.model, self.input_ids, reference)
