"""What ``tightfit run`` does with a model that generates text (a causal LM, an
encoder-decoder): the prompt and the tokens to generate taken from the options, the
generation's report (the text, time to first token, decode speed), and its quality, the
token agreement with full precision (teacher-forced)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from tightfit.app.generation import Generation, token_agreement
from tightfit.app.jobs import Job
from tightfit.loading import checkpoint_dtype

if TYPE_CHECKING:
    from tightfit import backends
    from tightfit.app.run import RunOptions, RunReport
    from tightfit.memory import Measurement

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_PROMPT", "GenerationJob"]

#: What a model continues, and for how many tokens, unless told otherwise.
DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived"
DEFAULT_MAX_NEW_TOKENS = 16


class GenerationJob(Job):
    """Generates ``max_new_tokens`` greedily from the prompt; quality is the token agreement
    with full precision. Subclasses make the generation (:meth:`call`) and plan it."""

    quality_metric = "token agreement vs full precision"
    quality_row = "token agreement, {changes} vs full"
    #: Whether decoding replays a captured graph (a causal LM decides it at its first call).
    graph: bool | None = False

    def __init__(
        self, folder: Path, device: torch.device, options: RunOptions, backend: backends.Backend, skeleton: Any = None
    ) -> None:
        super().__init__(folder, device, options, backend, skeleton)
        self.dtype = checkpoint_dtype(self.model.config)
        self.prompt = DEFAULT_PROMPT if options.prompt is None else options.prompt
        self.max_new_tokens = DEFAULT_MAX_NEW_TOKENS if options.max_new_tokens is None else options.max_new_tokens
        self.input_ids = self.tokenizer(self.prompt, return_tensors="pt").input_ids.to(device)
        self.synchronize = lambda: backend.synchronize(device)

    def decode_steps(self) -> int:
        """The one-token forwards after the prefill: every new token but the first."""
        return self.max_new_tokens - 1

    def result(self) -> Generation:
        """One generation: what quality compares."""
        return self.call()

    def _text(self, tokens: tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def fill(self, report: RunReport, calls: list[Generation], reference: Generation | None) -> None:
        last = calls[-1]
        report.prompt = self.prompt
        report.prompt_tokens = int(self.input_ids.shape[1])
        report.generated_text = self._text(last.tokens)
        report.new_tokens = len(last.tokens)
        report.time_to_first_token_seconds = statistics.median(call.prefill_seconds for call in calls)
        rates = [call.decode_tokens_per_second for call in calls if call.decode_tokens_per_second is not None]
        report.decode_tokens_per_second = statistics.median(rates) if rates else None
        report.decode_graph = self.graph
        if reference is not None:
            report.full_text = self._text(reference.tokens)
            report.token_agreement = report.quality = self._agreement(reference.tokens)

    def _agreement(self, reference: tuple[int, ...]) -> float:
        """The share of ``reference``'s next-token choices this model keeps (teacher-forced)."""
        return token_agreement(self.model, self.input_ids, reference)

    @staticmethod
    def result_table(report: RunReport) -> Table:
        text = Table(title="greedy generation", show_header=False)
        text.add_column("")
        text.add_column("", overflow="fold")
        text.add_row("prompt", report.prompt)
        text.add_row(f"{report.new_tokens} new tokens", report.generated_text)
        if report.full_text is not None:
            text.add_row("full precision", report.full_text)
        return text

    @staticmethod
    def speed_rows(report: RunReport, measured: Measurement) -> list[tuple[str, str]]:
        rate = report.decode_tokens_per_second
        replayed = ", replayed from a captured CUDA graph" if report.decode_graph else ""
        return [
            (
                f"time to first token ({report.prompt_tokens}-token prompt, median)",
                f"{report.time_to_first_token_seconds * 1e3:.1f} ms",
            ),
            (f"decode speed (median{replayed})", "-" if rate is None else f"{rate:.1f} tokens/s"),
            (
                f"generation of {report.new_tokens} tokens (median of {len(measured.seconds)})",
                f"{measured.median_seconds * 1e3:.1f} ms",
            ),
        ]
