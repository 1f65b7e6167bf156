"""PNG timelines of memory (private): the shared drawing behind ``plan.plot(path)``
(``tightfit plan --plot``) and ``MemoryTimeline.plot(path)`` (``tightfit run --timeline``).

matplotlib comes with the ``tightfit[plot]`` extra; :func:`check_png_path` lets a command
refuse a bad path, or a missing matplotlib, before it spends time running a model.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tightfit._format import human_bytes
from tightfit._validate import check_type

if TYPE_CHECKING:
    from tightfit.memory import MemoryTimeline

__all__: list[str] = []

MIB = 1024 * 1024


def check_png_path(name: str, path: Any, feature: str) -> Path:
    """``path`` as a Path: a .png file in an existing folder, with matplotlib installed for ``feature``."""
    check_type(name, path, (str, Path))
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise ValueError(f"{name}={str(path)!r} must end in .png")
    if not target.parent.is_dir():
        raise ValueError(f"{name}={str(path)!r}: the folder {str(target.parent)!r} does not exist")
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(f"{feature} needs matplotlib; install it with: pip install 'tightfit[plot]'")
    return target


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (no window)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as module

    return module


def draw_live(axis: Any, live: Sequence[int], label: str) -> None:
    """Bytes per step as a filled step curve, in MiB, outlined so that one-step spikes show."""
    heights = [value / MIB for value in live]
    steps = range(len(heights) + 1)
    filled = axis.fill_between(steps, heights + heights[-1:], step="post", alpha=0.5, label=label)
    axis.step(steps, heights + heights[-1:], where="post", linewidth=0.6, color=filled.get_facecolor()[0][:3])


def draw_level(axis: Any, nbytes: int, label: str, note: str = "", **style: Any) -> None:
    """A horizontal line at ``nbytes`` (a budget, an arena, a bound), in MiB, labelled with its size."""
    axis.axhline(nbytes / MIB, label=f"{label} {human_bytes(nbytes)}{note}", **style)


def draw_marks(axis: Any, marks: Sequence[tuple[int, str]]) -> None:
    """A vertical line where a phase starts (a backward graph, decoding), labelled at the top."""
    for index, label in marks:
        axis.axvline(index - 0.5, color="black", linewidth=0.8)
        axis.text(index, axis.get_ylim()[1] * 0.95, f" {label}", fontsize="small", va="top")


def save(figure: Any, target: Path) -> Path:
    figure.tight_layout()
    figure.savefig(target, dpi=100)
    pyplot().close(figure)
    return target


def plot_timeline(
    timeline: MemoryTimeline,
    path: str | Path,
    *,
    title: str = "",
    budget_bytes: int | None = None,
    predicted_peak_bytes: int | None = None,
) -> Path:
    """The PNG of :meth:`tightfit.memory.MemoryTimeline.plot`."""
    target = check_png_path("path", path, "MemoryTimeline.plot")
    check_type("title", title, str)
    for name, value in (("budget_bytes", budget_bytes), ("predicted_peak_bytes", predicted_peak_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
    if not timeline.samples:
        raise ValueError("the timeline has no samples; record one with measure(..., timeline=True)")
    figure, axis = pyplot().subplots(figsize=(10, 3.6))
    draw_live(axis, timeline.samples, timeline.source)
    draw_level(axis, timeline.peak_bytes, "measured peak", color="tab:blue", linestyle=":")
    if budget_bytes is not None:
        draw_level(axis, budget_bytes, "budget", color="tab:red", linewidth=2.5)
    if predicted_peak_bytes is not None:
        draw_level(axis, predicted_peak_bytes, "predicted peak", color="tab:green", linestyle="--")
    axis.set_ylim(bottom=0)
    draw_marks(axis, timeline.marks)
    axis.set_title(title or f"memory on {timeline.device}")
    axis.set_xlabel("step (op in execution order)")
    axis.set_ylabel("MiB")
    axis.legend(loc="lower right", fontsize="small")
    return save(figure, target)
