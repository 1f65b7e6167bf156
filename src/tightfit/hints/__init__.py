"""Hints on regions of user code (D5): ``tightfit.hint(...)`` writes them, a backend reads
them from the traced graph with ``tightfit.hints_of(graph_module)``.

See docs/hints.md. Hints are validated when written; a backend honors the keys it
declares in ``Capabilities.hints`` and ignores the rest.
"""

from tightfit.hints.payload import HINT_KEY
from tightfit.hints.read import Region, hints_of, node_hints, node_regions
from tightfit.hints.schema import KNOWN_HINTS, ORDERS, SCHEDULES, is_vendor_key
from tightfit.hints.scope import HintScope, hint

__all__ = [
    "HINT_KEY",
    "HintScope",
    "KNOWN_HINTS",
    "ORDERS",
    "Region",
    "SCHEDULES",
    "hint",
    "hints_of",
    "is_vendor_key",
    "node_hints",
    "node_regions",
]
