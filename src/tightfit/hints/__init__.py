"""Hints on regions of user code (D5): ``tightfit.hint(...)`` writes them, a backend reads
them from the traced graph with ``tightfit.hints_of(graph_module)``.

See docs/hints.md. Hints are validated when written; a backend honors the keys it
declares in ``Capabilities.hints`` and ignores the rest.
"""

from tightfit._deprecation import renamed
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


__getattr__ = renamed(__name__, ORDERS=("HINT_ORDERS (the values of the order hint)", lambda: HINT_ORDERS))
