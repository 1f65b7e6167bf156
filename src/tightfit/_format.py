"""Human-readable numbers for reports (private)."""

from __future__ import annotations

__all__: list[str] = []


def human_bytes(value: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # internal invariant: the loop always returns


def dtype_names(dtypes: frozenset) -> str:
    """Short, sorted dtype names: ``bfloat16, float16``."""
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
