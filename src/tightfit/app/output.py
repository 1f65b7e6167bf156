"""What ``tightfit run`` prints (private): its report as JSON data or as rich tables, one
layout for both kinds of model, with the kind's own rows (sentence pairs and cosine for
encoders; text, speeds and token agreement for causal LMs), and with a budget the plan
and its prediction against the measurement."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tightfit._format import human_bytes
from tightfit.app.budget import Budgeted
from tightfit.app.run import RunReport, RunStart
from tightfit.kinds import get_kind

__all__: list[str] = []


#: what ``Measurement.allocated_peak_bytes`` counts, for labels
_ALLOCATED = "allocated: weights + the run's tensors + scratch inside ops"
_LOADING = "live tensors: weights held + the unit being read and converted"


def _milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _budget_data(report: RunReport) -> dict[str, Any]:
    """The budget's figures for ``--json``; None everywhere without a budget."""
    budgeted, measured = report.budgeted, report.measured_peak_bytes
    if budgeted is None:
        keys = (
            "budget_bytes",
            "predicted_peak_bytes",
            "measured_peak_bytes",
            "within_budget",
            "predicted_over_measured",
            "prediction_covers",
            "kv_cache_bytes",
            "context",
            "kv_cache_format",
            "applies_nothing",
            "plan",
            "load_seconds",
            "load_peak_bytes",
            "load_peak_rss_bytes",
        )
        return dict.fromkeys(keys)
    return {
        "budget_bytes": report.budget_bytes,
        "predicted_peak_bytes": budgeted.predicted_peak_bytes,
        "measured_peak_bytes": measured,
        "within_budget": measured <= report.budget_bytes,
        "predicted_over_measured": budgeted.predicted_peak_bytes / measured,
        "prediction_covers": budgeted.covers,
        "kv_cache_bytes": budgeted.kv_cache_bytes,
        "context": budgeted.context,
        "kv_cache_format": budgeted.kv_format,
        "applies_nothing": budgeted.plan.applies_nothing,
        "plan": budgeted.plan.to_dict(),
        "load_seconds": report.load_seconds,
        "load_peak_bytes": report.load_peak_bytes,
        "load_peak_rss_bytes": report.load_peak_rss_bytes,
    }


def report_data(report: RunReport) -> dict[str, Any]:
    """The ``--json`` form: every figure, None where the kind or the run has none."""
    measured = report.measurement
    return {
        "model": report.model,
        "kind": report.kind,
        "backend": report.backend,
        "device": report.device,
        "weights_bytes": report.weights_bytes,
        "embedding_dim": report.embedding_dim,
        "latency_ms_median": measured.median_seconds * 1e3,
        "peak_bytes": measured.peak_bytes,
        "allocated_peak_bytes": measured.allocated_peak_bytes,
        "peak_rss_bytes": measured.peak_rss_bytes,
        "memory_source": measured.source,
        "pairs": [{"a": a, "b": b, "cosine": score} for a, b, score in report.pairs],
        "prompt": report.prompt,
        "prompt_tokens": report.prompt_tokens,
        "generated_text": report.generated_text,
        "new_tokens": report.new_tokens,
        "time_to_first_token_ms": _milliseconds(report.time_to_first_token_seconds),
        "decode_tokens_per_second": report.decode_tokens_per_second,
        "decode_graph": report.decode_graph,
        "full_text": report.full_text,
        "quant": report.quant,
        "full_weights_bytes": report.full_weights_bytes,
        "min_cosine_to_full": report.min_cosine_to_full,
        "token_agreement": report.token_agreement,
        "quality": {"metric": report.quality_metric, "value": report.quality},
        "kept_8bit": list(report.kept_8bit),
        "kept_8bit_linears": report.kept_8bit_linears,
        "kept_8bit_bytes": report.kept_8bit_bytes,
        "storage_dtype": report.storage_dtype,
        "offload": report.offload,
        "device_weights_bytes": report.device_weights_bytes,
        "timeline": report.timeline_path,
        **_budget_data(report),
    }


def _print_plan(budgeted: Budgeted, budget_bytes: int, console: Console) -> None:
    plan = budgeted.plan
    if plan.applies_nothing:
        console.print(
            f"budget {human_bytes(budget_bytes)} covers the unchanged model "
            f"({human_bytes(plan.full_peak_bytes)} predicted): nothing applied, weights as loaded",
            highlight=False,
        )
        return
    console.print(escape(str(plan)), highlight=False, soft_wrap=True)


def print_start(start: RunStart, console: Console) -> None:
    """What a run prints before it measures: the model, the backend and, with a budget,
    the plan (before any weight is read); flushed, so that it shows at once even where
    stdout is a pipe."""
    label = get_kind(start.kind).label
    kind = f" ({label})" if label else ""
    console.print(f"model    {start.model}{kind}", highlight=False, markup=False)
    console.print(f"backend  {start.backend} ({start.device})", highlight=False, markup=False)
    if start.budgeted is not None:
        _print_plan(start.budgeted, start.budget_bytes, console)
    console.file.flush()


def _budget(report: RunReport) -> Table:
    budgeted, measured = report.budgeted, report.measured_peak_bytes
    table = Table(title="budget: predicted against measured (loading and the run)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("budget", f"{human_bytes(report.budget_bytes)} ({report.budget_bytes:,} B)")
    table.add_row(
        "predicted peak", f"{human_bytes(budgeted.predicted_peak_bytes)} ({budgeted.predicted_peak_bytes:,} B)"
    )
    table.add_row("measured peak, loading or running (the larger)", f"{human_bytes(measured)} ({measured:,} B)")
    ratio = budgeted.predicted_peak_bytes / measured
    table.add_row("predicted / measured", f"{ratio:.3f} ({(ratio - 1) * 100:+.1f}%)")
    table.add_row("measured within budget", "yes" if measured <= report.budget_bytes else "[red]NO[/red]")
    return table


def print_report(report: RunReport, console: Console, *, started: bool = False) -> None:
    """The tables: what ran, the plan under a budget, what it produced, and the measured
    figures. ``started``: :func:`print_start` has shown what ran and the plan already."""
    measured = report.measurement
    if not started:
        print_start(
            RunStart(report.model, report.kind, report.backend, report.device, report.budget_bytes, report.budgeted),
            console,
        )
    job = get_kind(report.kind).job_class()
    console.print(job.result_table(report))
    figures = Table(title="measured")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    if report.changes is not None:
        figures.add_row("weights, full precision", human_bytes(report.full_weights_bytes))
        stored = report.quant or report.storage_dtype or (report.changes if report.budgeted else "as loaded")
        figures.add_row(f"weights, {stored}", human_bytes(report.weights_bytes))
        if report.kept_8bit:
            kept = f"{', '.join(report.kept_8bit)}: {report.kept_8bit_linears} Linear, {human_bytes(report.kept_8bit_bytes)}"
            figures.add_row("kept in 8 bits (later half of the layers)", kept)
        figures.add_row(f"weights in {report.device} memory between forwards", human_bytes(report.device_weights_bytes))
        quality = "not measured (no full-precision reference)" if report.quality is None else f"{report.quality:.4f}"
        figures.add_row(job.quality_row.format(changes=report.changes), quality)
    else:
        figures.add_row("weights", human_bytes(report.weights_bytes))
    for label, value in job.speed_rows(report, measured):
        figures.add_row(label, value)
    figures.add_row(f"peak memory, {measured.source}", human_bytes(measured.peak_bytes))
    if report.load_seconds is not None:
        figures.add_row("load: checkpoint streamed into the plan", f"{report.load_seconds:.2f} s")
        figures.add_row(f"peak memory while loading, {_LOADING}", human_bytes(report.load_peak_bytes))
        if report.load_peak_rss_bytes is not None:
            figures.add_row("peak RSS while loading, whole process", human_bytes(report.load_peak_rss_bytes))
    if measured.peak_rss_bytes is not None:  # the CPU: the allocator's view beside the per-op count
        figures.add_row(f"peak memory, {_ALLOCATED}", human_bytes(measured.allocated_peak_bytes))
        figures.add_row("peak RSS, whole process (code and libraries too)", human_bytes(measured.peak_rss_bytes))
    console.print(figures)
    if report.budgeted is not None:
        console.print(_budget(report))
        console.print(f"the prediction covers {report.budgeted.covers}", highlight=False, markup=False, soft_wrap=True)
    if report.timeline_path is not None:
        console.print(f"memory timeline written to {report.timeline_path}", highlight=False, markup=False)
