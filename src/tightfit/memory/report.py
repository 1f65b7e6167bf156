"""The memory plan as a table (``print(plan)``) and as a PNG timeline (``plan.plot(path)``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tightfit._format import human_bytes
from tightfit.memory.plot import check_png_path, draw_level, draw_live, draw_marks, pyplot, save

if TYPE_CHECKING:
    from tightfit.memory.plan import MemoryPlan

__all__ = ["plot", "render"]

_COLUMNS = ("device", "weights", "inputs", "arena", "lower bound", "arena/bound", "live peak", "total", "strategy")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [
            cell.ljust(width) if column in (0, len(row) - 1) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return lines


def render(plan: MemoryPlan) -> str:
    """A readable table: per device weights, inputs, arena, lower bound; the peak and what is alive there."""
    mode = "training step (forward + backward)" if plan.training else "inference"
    steps = len(plan.timeline.steps)
    lines = [
        f"memory plan: {plan.model}, {mode}, {plan.runtime}, backend {plan.backend}, {steps} steps, "
        f"alignment {plan.alignment} B"
    ]
    rows = [_COLUMNS]
    for name, device in plan.devices.items():
        rows.append(
            (
                name,
                human_bytes(device.weights_bytes),
                human_bytes(device.inputs_bytes),
                human_bytes(device.arena_bytes),
                human_bytes(device.lower_bound_bytes),
                f"{device.ratio:.3f}",
                human_bytes(device.live_peak_bytes),
                human_bytes(device.total_bytes),
                device.strategy,
            )
        )
    lines += _table(rows)
    lines.append(f"predicts: {plan.covers}; not inductor or a backend's own compiler (see tightfit.memory.NOT_COVERED)")
    lines.append(f"limits: {plan.limits}")
    for name, device in plan.devices.items():
        if device.peak_step is None:
            continue
        lines.append(
            f"peak on {name}: step {device.peak_step} of {steps}, {device.peak_graph} graph, "
            f"node {device.peak_node}; largest tensors alive there:"
        )
        for tensor, graph, nbytes in device.largest_live:
            lines.append(f"  {human_bytes(nbytes):>10}  {tensor} ({graph})")
    for graph, peaks in plan.order_peaks.items():
        if not peaks:  # eager: Python runs the module as written
            lines.append(f"order of the {graph} ops: as written (eager runs the module as it is)")
            continue
        listed = ", ".join(f"{order} {human_bytes(peak)}" for order, peak in peaks.items())
        lines.append(f"order of the {graph} graph: {plan.orders[graph]} kept (lower bounds: {listed})")
    lines += _arena_lines(plan)
    return "\n".join(lines)


def _arena_lines(plan: MemoryPlan) -> list[str]:
    """runtime="arena": each graph's execution arena, and the storages allocated outside it, largest first."""
    lines = []
    for graph, sizes in plan.run_arenas.items():
        listed = ", ".join(f"{device} {human_bytes(size)}" for device, size in sizes.items()) or "none"
        lines.append(f"execution arena of the {graph} graph: {listed}")
    if not plan.run_arenas:
        return lines
    reasons: dict[str, list[int]] = {}
    for entry in plan.outside:
        counted = reasons.setdefault(entry.reason, [0, 0])
        counted[0] += 1
        counted[1] += entry.nbytes
    total = sum(entry.nbytes for entry in plan.outside)
    lines.append(f"allocated outside the arena: {len(plan.outside)} tensors, {human_bytes(total)}")
    for reason, (count, nbytes) in sorted(reasons.items(), key=lambda item: -item[1][1]):
        ops = sorted({entry.op for entry in plan.outside if entry.reason == reason})
        shown = ", ".join(ops[:6]) + (", ..." if len(ops) > 6 else "")
        lines.append(f"  {human_bytes(nbytes):>10}  {count:4d} x {reason} ({shown})")
    return lines


def plot(plan: MemoryPlan, path: str | Path) -> Path:
    """Write a PNG: live bytes per device over the steps, the lower bound and the arena as lines."""
    target = check_png_path("path", path, "plan.plot")
    devices = list(plan.devices)
    figure, axes = pyplot().subplots(len(devices), 1, figsize=(12, 3.4 * len(devices)), squeeze=False)
    for axis, name in zip(axes[:, 0], devices):
        device = plan.devices[name]
        draw_live(axis, plan.timeline.live_bytes(name), "live tensors")
        axis.margins(y=0.12)  # room above the arena line, which is often the peak itself
        draw_level(axis, device.arena_bytes, "arena", f" ({device.strategy})", color="tab:red", linewidth=2.5)
        draw_level(axis, device.lower_bound_bytes, "lower bound", color="tab:green", linestyle="--")
        if device.peak_step is not None:
            axis.axvline(device.peak_step, color="gray", linestyle=":", label=f"peak: {device.peak_node}")
        steps = plan.timeline.step_graphs
        draw_marks(axis, [(index, steps[index]) for index in range(1, len(steps)) if steps[index] != steps[index - 1]])
        held = human_bytes(device.weights_bytes + device.inputs_bytes)
        axis.set_title(
            f"{plan.model} on {name}, {'training step' if plan.training else 'inference'} ({plan.runtime}): "
            f"activations, outputs, workspaces; weights and inputs ({held}) not drawn",
            fontsize="medium",
        )
        axis.set_xlabel("step (op in execution order)")
        axis.set_ylabel("MiB")
        axis.set_ylim(bottom=0)
        # beside the axes, not over them: inside, the legend covered the peak marker
        axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")
    return save(figure, target)
