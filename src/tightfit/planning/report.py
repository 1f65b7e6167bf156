"""The memory plan as a table (``print(plan)``) and as a PNG timeline (``plan.plot(path)``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from tightfit._format import human_bytes
from tightfit._validate import check_type

if TYPE_CHECKING:
    from tightfit.planning.plan import MemoryPlan

__all__ = ["plot", "render"]

_COLUMNS = ("device", "weights", "inputs", "arena", "lower bound", "arena/bound", "live peak", "total", "placement")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [cell.ljust(width) if column in (0, len(row) - 1) else cell.rjust(width)
                 for column, (cell, width) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return lines


def render(plan: MemoryPlan) -> str:
    """A readable table: per device weights, inputs, arena, lower bound; the peak and what is alive there."""
    mode = "training step (forward + backward)" if plan.training else "inference"
    steps = len(plan.timeline.steps)
    lines = [f"memory plan: {plan.model}, {mode}, {plan.runtime}, backend {plan.backend}, {steps} steps, "
             f"alignment {plan.alignment} B"]
    rows = [_COLUMNS]
    for name, device in plan.devices.items():
        rows.append((name, human_bytes(device.weights_bytes), human_bytes(device.inputs_bytes),
                     human_bytes(device.arena_bytes), human_bytes(device.lower_bound_bytes), f"{device.ratio:.3f}",
                     human_bytes(device.live_peak_bytes), human_bytes(device.total_bytes), device.placement))
    lines += _table(rows)
    for name, device in plan.devices.items():
        if device.peak_step is None:
            continue
        lines.append(f"peak on {name}: step {device.peak_step} of {steps}, {device.peak_graph} graph, "
                     f"node {device.peak_node}; largest tensors alive there:")
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
    check_type("path", path, (str, Path))
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise ValueError(f"path={str(path)!r} must end in .png")
    if not target.parent.is_dir():
        raise ValueError(f"path={str(path)!r}: the folder {str(target.parent)!r} does not exist")
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("plan.plot needs matplotlib; install it with: pip install 'tightfit[plot]'")
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot

    devices = list(plan.devices)
    figure, axes = pyplot.subplots(len(devices), 1, figsize=(10, 3.2 * len(devices)), squeeze=False)
    mib = 1024 * 1024
    for axis, name in zip(axes[:, 0], devices):
        device = plan.devices[name]
        live = plan.timeline.live_bytes(name)
        heights = [value / mib for value in live]
        axis.fill_between(range(len(live) + 1), heights + heights[-1:], step="post", alpha=0.5, label="live tensors")
        axis.axhline(device.arena_bytes / mib, color="tab:red", linewidth=2.5,
                     label=f"arena {human_bytes(device.arena_bytes)} ({device.placement})")
        axis.axhline(device.lower_bound_bytes / mib, color="tab:green", linestyle="--",
                     label=f"lower bound {human_bytes(device.lower_bound_bytes)}")
        if device.peak_step is not None:
            axis.axvline(device.peak_step, color="gray", linestyle=":", label=f"peak: {device.peak_node}")
        _mark_graphs(axis, plan.timeline.step_graphs)
        axis.set_title(f"{plan.model} on {name}: {'training step' if plan.training else 'inference'}")
        axis.set_xlabel("step (op in execution order)")
        axis.set_ylabel("MiB")
        axis.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(target, dpi=100)
    pyplot.close(figure)
    return target


def _mark_graphs(axis, step_graphs: list[str]) -> None:
    """A vertical line where one graph ends and the next (the backward) starts."""
    for index in range(1, len(step_graphs)):
        if step_graphs[index] != step_graphs[index - 1]:
            axis.axvline(index - 0.5, color="black", linewidth=0.8)
            axis.text(index, axis.get_ylim()[1] * 0.95, f" {step_graphs[index]}", fontsize="small", va="top")
