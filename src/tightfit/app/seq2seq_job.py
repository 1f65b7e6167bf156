"""``tightfit run`` on an encoder-decoder (T5, BART): the prompt is the encoder's input, and
the decoder generates greedily from its start token. Planned as the encoder's forward and
the first decoder step (the cross-attention's cache made there), with the decoder's
self-attention cache growing over the one-token steps after it as a reservation of the
plan; quality is the token agreement with full precision, teacher-forced."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tightfit._format import human_bytes
from tightfit.app import kv_cache
from tightfit.app.budget import Budgeted
from tightfit.app.causal_lm_job import CausalLMJob
from tightfit.app.generation import Generation, decoder_start, generate_seq2seq, seq2seq_agreement
from tightfit.app.jobs import Job
from tightfit.app.models import load_model
from tightfit.fitting import FitPlan
from tightfit.kinds import ENCODER_DECODER

if TYPE_CHECKING:
    from collections.abc import Callable

    from tightfit import backends
    from tightfit.app.run import RunOptions

__all__ = ["Seq2SeqJob"]


class Seq2SeqJob(CausalLMJob):
    """Generates ``max_new_tokens`` greedily from the prompt; the report is a causal LM's
    (the text, time to first token, decode speed, token agreement)."""

    def __init__(
        self, folder: Path, device: torch.device, options: RunOptions, backend: backends.Backend, skeleton: Any = None
    ) -> None:
        Job.__init__(self, folder, device, options, backend, skeleton)  # not a causal LM's checks and cache
        self._take_prompt(options, backend)
        self.kv_format = "model"
        self.graph = False  # a captured decode is a causal LM's for now

    @classmethod
    def load_full(cls, folder: Path, device: torch.device) -> Any:
        return load_model(folder, device, ENCODER_DECODER)[0]

    def call(self) -> Generation:
        return generate_seq2seq(self.model, self.input_ids, self.max_new_tokens, self.synchronize)

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """The encoder's forward and the first decoder step: what the first token costs."""
        return {"input_ids": self.input_ids, "decoder_input_ids": decoder_start(self.model, self.input_ids.device)}

    def kv_cache_bytes(self) -> int:
        """The decoder's self-attention cache growing over the one-token steps after the first."""
        return (self.max_new_tokens - 1) * kv_cache.bytes_per_token(self.model.config, self.dtype)

    def kv_decoded_bytes(self) -> int:
        return 0

    def planned_context(self) -> None:
        """The decoder's cache is planned for this run's tokens; ``--context`` is a causal LM's."""
        return None

    def choose_kv_format(self, planned: Callable[[], Budgeted], kv_format: str, budget: int) -> Budgeted:
        return planned()

    def carried_out(self, plan: FitPlan) -> Budgeted:
        return Budgeted(plan, self.covers())

    def covers(self) -> str:
        return (
            f"the encoder over the {self.input_ids.shape[1]}-token prompt and the first decoder step, plus the "
            f"decoder's self-attention cache growing over the {self.max_new_tokens - 1} one-token decode forwards "
            f"({human_bytes(self.kv_cache_bytes())}); {kv_cache.describe('model', self.model.config, self.dtype)}"
        )

    def _agreement(self, reference: tuple[int, ...]) -> float:
        return seq2seq_agreement(self.model, self.input_ids, reference)
