"""Names renamed in this release, kept working for one more with a DeprecationWarning.

A module keeps its old names by assigning ``__getattr__ = renamed(__name__, Old=("New", lambda: New))``:
Python calls a module's ``__getattr__`` only for a name the module does not define, so the
new names cost nothing and only a use of an old one warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["renamed"]


def renamed(module: str, **old_names: tuple[str, Callable[[], Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` giving each old name's value (``old=(new name, getter)``) with a warning."""

    def __getattr__(name: str, stacklevel: int = 2) -> Any:  # stacklevel: 3 when called from another __getattr__
        if name not in old_names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_name, value = old_names[name]
        warnings.warn(
            f"{module}.{name} is renamed {new_name}; {name} goes in the next release",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
        return value()

    return __getattr__
