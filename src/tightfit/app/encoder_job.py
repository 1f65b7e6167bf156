"""``tightfit run`` on an encoder: embed a batch of sentences, show the most similar pairs;
quality is the lowest cosine of an embedding against full precision."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from tightfit.app.jobs import Job
from tightfit.app.models import embed
from tightfit.kinds import ENCODER

if TYPE_CHECKING:
    from tightfit import backends
    from tightfit.app.run import RunOptions, RunReport
    from tightfit.memory import Measurement

__all__ = ["EncoderJob"]


def _most_similar(embeddings: torch.Tensor, sentences: tuple[str, ...], count: int) -> list[tuple[str, str, float]]:
    scores = embeddings @ embeddings.T
    rows, cols = torch.triu_indices(len(sentences), len(sentences), offset=1)
    values = scores[rows, cols]
    order = values.argsort(descending=True)[:count]
    return [(sentences[int(rows[i])], sentences[int(cols[i])], float(values[i])) for i in order]


class EncoderJob(Job):
    """Embeds the sentences; quality is the lowest cosine of an embedding against full precision."""

    kind = ENCODER
    quality_metric = "embedding cosine vs full precision (lowest)"
    quality_row = "embedding cosine, {changes} vs full (lowest)"

    def __init__(
        self, folder: Path, device: torch.device, options: RunOptions, backend: backends.Backend, skeleton: Any = None
    ) -> None:
        super().__init__(folder, device, options, backend, skeleton)
        self.sentences = options.sentences
        self.top_pairs = options.top_pairs

    def call(self) -> None:
        embed(self.model, self.tokenizer, list(self.sentences), self.device)

    def example_inputs(self) -> dict[str, torch.Tensor]:
        """The batch ``call`` embeds: what a plan is made for."""
        return dict(
            self.tokenizer(list(self.sentences), padding=True, truncation=True, return_tensors="pt").to(self.device)
        )

    def covers(self) -> str:
        ids = self.example_inputs()["input_ids"]
        return f"one forward over the {ids.shape[0]} sentences ({ids.shape[0]} x {ids.shape[1]} tokens)"

    def result(self) -> torch.Tensor:
        """The embeddings, on the CPU: what quality compares."""
        return embed(self.model, self.tokenizer, list(self.sentences), self.device).cpu()

    def fill(self, report: RunReport, calls: list, reference: torch.Tensor | None) -> None:
        embeddings = self.result()
        report.embedding_dim = int(embeddings.shape[-1])
        report.pairs = _most_similar(embeddings, self.sentences, self.top_pairs)
        if reference is not None:
            report.min_cosine_to_full = report.quality = float((embeddings * reference).sum(-1).min())

    @staticmethod
    def result_table(report: RunReport) -> Table:
        pairs = Table(title="most similar sentence pairs")
        for column in ("cosine", "sentence", "sentence"):
            pairs.add_column(column)
        for a, b, score in report.pairs:
            pairs.add_row(f"{score:.3f}", a, b)
        return pairs

    @staticmethod
    def speed_rows(report: RunReport, measured: Measurement) -> list[tuple[str, str]]:
        return [(f"latency (median of {len(measured.seconds)})", f"{measured.median_seconds * 1e3:.1f} ms")]
