"""The table ``print(fit_plan)`` shows (private)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tightfit._format import human_bytes

if TYPE_CHECKING:
    from tightfit.fitting.plan import FitPlan

__all__: list[str] = []


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _priced(plan: FitPlan) -> str:
    """What the time model's figure covers."""
    if not plan.decode_steps:
        return "per forward"
    return f"of the planned forward and {plan.decode_steps:,} one-token forward{'s' if plan.decode_steps > 1 else ''}"


def render(plan: FitPlan) -> str:
    """A header with budget and predicted peak, then one row per unit."""
    lines = [
        f"fit plan: {plan.model} on {plan.device} (backend {plan.backend}), budget {human_bytes(plan.budget_bytes)} ({plan.budget_bytes} B)",
        f"predicted peak {human_bytes(plan.predicted_peak_bytes)} = weights {human_bytes(plan.predicted_weights_bytes)}"
        f" + activations {human_bytes(plan.predicted_activation_bytes)} + transient {human_bytes(plan.predicted_transient_bytes)}"
        f"{f' + reserved {human_bytes(plan.reserved_bytes)}' if plan.reserved else ''}"
        f"; unchanged model {human_bytes(plan.full_peak_bytes)}",
        f"time model, weight work {_priced(plan)} (ranks plans; not a latency) {_ms(plan.predicted_seconds)} (unchanged {_ms(plan.full_seconds)})",
    ]
    if plan.phase_peaks:
        cache = plan.kv_cache
        lines.append(
            f"by phase: prefill {human_bytes(plan.phase_peaks['prefill'])}; last decode step "
            f"{human_bytes(plan.phase_peaks['decode'])}"
            + (
                f", the KV cache ({cache['format']}) at {cache['context']:,} positions {human_bytes(cache['bytes'])} "
                f"({cache['bytes']:,} B) inside it"
                if cache
                else ""
            )
        )
    if plan.reserved:
        held = "; ".join(f"{what} {human_bytes(size)} ({size:,} B)" for what, size in plan.reserved.items())
        lines.append(f"reserved on the device outside the weights and the planned forward: {held}")
    if plan.quality:
        lines.append(f"quality: {plan.quality}")
    if plan.covers_load:
        lines.append(
            f"loading covered: peak {human_bytes(plan.predicted_load_peak_bytes)} while the checkpoint streams in "
            f"(weights held + the largest unit as read and converting"
            + "".join(f"; {what} {human_bytes(size)} ({size:,} B)" for what, size in plan.reserved_loading.items())
            + ")"
        )
    if plan.disk_reads:
        lines.append(f"units on disk read {plan.disk_reads}")
    if plan.int8_outliers:
        lines.append(f"int8 outlier columns {plan.int8_outliers}")
    if plan.hints:
        first = next(iter(plan.hints.values()))
        hinted = ", ".join(f"{k}={v!r}" for k, v in first.items())
        same = all(region == first for region in plan.hints.values())
        lines.append(
            f"hints on {len(plan.hints)} module(s) ({', '.join(plan.hints)}): "
            f"{hinted if same else 'see plan.hints'}; the predicted peak holds only compiled "
            f"(plan.compile(model): torch.compile with the tightfit backend, FX execution), not in eager calls"
        )
    if plan.applies_nothing:
        lines.append("the budget covers the unchanged model: apply() changes nothing")
    header = ("module", "before", "after", "held", "storage", "where", "time", "why")
    rows = [header] + [
        (
            e.module,
            human_bytes(e.bytes_before),
            human_bytes(e.bytes_after),
            human_bytes(e.held_bytes),
            e.storage,
            e.placement,
            _ms(e.seconds),
            e.why,
        )
        for e in plan.entries
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines.append("")
    for index, row in enumerate(rows):
        cells = (
            [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:-1], widths[1:])] + [row[-1]]
        )
        lines.append("  ".join(cells))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 3)
    return "\n".join(lines)
