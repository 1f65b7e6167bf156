"""Human-readable numbers for reports (private)."""

from __future__ import annotations

__all__: list[str] = []


def human_bytes(value: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if value is None:
        return "-"
    if abs(value) < 1024:
        return f"{value} B"
    size = float(value)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if abs(size) < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} TiB"


def dtype_names(dtypes: frozenset) -> str:
    """Short, sorted dtype names: ``bfloat16, float16``."""
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
