"""Hints on regions of user code (D5): ``tightfit.hint(...)`` writes them, a backend reads
them from the traced graph with ``tightfit.hints_of(graph_module)``.

See docs/hints.md. Hints are validated when written; a backend honors the keys it
declares in ``Capabilities.hints`` and ignores the rest.
"""

import warnings
from typing import Any

from tightfit.hints.payload import HINT_KEY
from tightfit.hints.read import Region, hints_of, node_hints, node_regions, owning_region
from tightfit.hints.schema import HINT_ORDERS, HINTS, KNOWN_HINTS, SCHEDULES, HintSpec, is_vendor_key, keys_honored_by
from tightfit.hints.scope import HintScope, hint

__all__ = [
    "HINTS",
    "HINT_KEY",
    "HINT_ORDERS",
    "HintScope",
    "HintSpec",
    "KNOWN_HINTS",
    "Region",
    "SCHEDULES",
    "hint",
    "hints_of",
    "is_vendor_key",
    "keys_honored_by",
    "node_hints",
    "node_regions",
    "owning_region",
]


def __getattr__(name: str) -> Any:
    if name == "ORDERS":  # renamed: "order" also names the graph's topological orders (TOPOLOGICAL_ORDERS)
        warnings.warn(
            "tightfit.hints.ORDERS is deprecated; use tightfit.hints.HINT_ORDERS (the values of the order hint)",
            DeprecationWarning,
            stacklevel=2,
        )
        return HINT_ORDERS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
