"""What ``tightfit run`` does with a model of one kind (:mod:`tightfit.kinds`): the calls it
times, the inputs a plan is made for, what the plan reserves beside the weights, the
quality figure against full precision, and how the report shows the result. A kind
without a cache between forwards (an encoder, a classifier) implements the abstract
methods only; the defaults here reserve nothing."""

from __future__ import annotations

import abc
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tightfit.app.budget import Budgeted
from tightfit.app.models import load_model, load_tokenizer
from tightfit.fitting import FitPlan
from tightfit.fitting.traced import DecodeTrace

if TYPE_CHECKING:  # run.py imports the jobs only at run time, through the kinds' registry
    from rich.table import Table

    from tightfit import backends
    from tightfit.app.run import RunOptions, RunReport
    from tightfit.memory import Measurement

__all__ = ["Job"]


class Job(abc.ABC):
    """One run's model and what it does with it. ``model`` is loaded as its ``kind``'s auto
    class builds it (:mod:`tightfit.kinds`), or is the skeleton a plan streams the
    checkpoint into (``skeleton``, the weights still on meta); ``tokenizer`` is the folder's."""

    #: The quality figure's name in reports (the JSON's ``quality.metric``), and its row's
    #: label in the table (``{changes}``: what was done to the weights).
    quality_metric: str = "quality vs full precision"
    quality_row: str = "quality, {changes} vs full"
    #: The KV cache's format where the kind keeps one between forwards.
    kv_format: str | None = None

    #: The registered kind (:mod:`tightfit.kinds`) whose auto class loads the model.
    kind: str

    model: Any

    def __init__(
        self, folder: Path, device: torch.device, options: RunOptions, backend: backends.Backend, skeleton: Any = None
    ) -> None:
        self.folder, self.device = folder, device
        if skeleton is None:
            self.model, self.tokenizer = load_model(folder, device, self.kind)
        else:  # planned first, streamed in later
            self.model, self.tokenizer = skeleton, load_tokenizer(folder)
        #: With a budget: what it leaves above the plan's predicted peak (a job may spend it).
        self.headroom: int | None = None

    @classmethod
    def load_full(cls, folder: Path, device: torch.device) -> Any:
        """The full-precision model of ``folder`` on ``device``: the quality reference."""
        return load_model(folder, device, cls.kind)[0]

    @abc.abstractmethod
    def call(self) -> Any:
        """One timed call (an embedding batch, a generation); its result is kept for :meth:`fill`."""

    @abc.abstractmethod
    def example_inputs(self) -> dict[str, torch.Tensor]:
        """The inputs of the forward a plan is made for."""

    @abc.abstractmethod
    def covers(self) -> str:
        """What the plan's prediction covers, in words."""

    @abc.abstractmethod
    def result(self) -> Any:
        """What quality compares: this model's output, as the reference model's is taken."""

    @abc.abstractmethod
    def fill(self, report: RunReport, calls: list, reference: Any) -> None:
        """Set the report's figures of this kind from the timed ``calls`` (their results)
        and, where there is one, the full-precision ``reference`` (:meth:`result`'s);
        ``report.quality`` among them."""

    @staticmethod
    @abc.abstractmethod
    def result_table(report: RunReport) -> Table:
        """The report's table of what the model produced."""

    @staticmethod
    @abc.abstractmethod
    def speed_rows(report: RunReport, measured: Measurement) -> list[tuple[str, str]]:
        """The report's speed figures: (label, value) rows."""

    def decode_trace(self) -> DecodeTrace | None:
        """The last one-token forward after the planned one, for the plan to trace at the
        longest context (None: the run makes no such forward)."""
        return None

    def decode_steps(self) -> int:
        """Forwards after the planned one that the plan prices (one token each)."""
        return 0

    def planned_context(self) -> int | None:
        """Positions a cache is planned for (None: no cache)."""
        return None

    def choose_kv_format(self, planned: Callable[[], Budgeted], kv_format: str, budget: int) -> Budgeted:
        """``planned()`` with the cache in the format chosen (no cache: as it is)."""
        return planned()

    def carried_out(self, plan: FitPlan) -> Budgeted:
        """``plan`` as made before (``--plan``)."""
        return Budgeted(plan, self.covers())
