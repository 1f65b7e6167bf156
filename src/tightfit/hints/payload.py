"""What a hinted region leaves on FX nodes: one entry under ``node.meta["custom"]["tightfit"]``.

The entry is the chain of regions the node sits in, outermost first, each with the
hints written on it, plus the merged hints (inner regions win). Chains rather than
merged dicts alone let ``hints_of`` rebuild every region, and let nested regions keep
their identity through dynamo, aot_autograd (forward and backward) and export. The
layout is private; read it with :func:`tightfit.hints_of` or :func:`node_hints`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch.fx

__all__ = ["HINT_KEY", "Chain", "make_payload", "nest", "payload_of"]

#: The one key tightfit owns in ``node.meta["custom"]``.
HINT_KEY = "tightfit"

#: ((region id, ((key, value), ...)), ...), outermost region first.
Chain = tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]

_region_ids = itertools.count(1)


def new_region_id() -> int:
    """A process-unique region id."""
    return next(_region_ids)


def merged(chain: Chain) -> dict[str, Any]:
    """The hints in force at the end of ``chain``: later (inner) levels win."""
    hints: dict[str, Any] = {}
    for _, declared in chain:
        hints.update(declared)
    return hints


def make_payload(chain: Chain) -> dict[str, Any]:
    return {"chain": tuple(chain), "hints": merged(chain)}


def nest(
    outer: dict[str, Any] | None, declared: Iterable[tuple[str, Any]], inner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A payload for a new region inside ``outer`` (and around ``inner``, when inlining)."""
    chain = tuple(outer["chain"]) if outer else ()
    chain += ((new_region_id(), tuple(declared)),)
    if inner:
        chain += tuple(inner["chain"])
    return make_payload(chain)


def payload_of(node: torch.fx.Node) -> dict[str, Any] | None:
    """The tightfit entry of a node, or None when no hinted region covers it."""
    custom = node.meta.get("custom")
    if not isinstance(custom, dict):
        return None
    payload = custom.get(HINT_KEY)
    return payload if isinstance(payload, dict) and "chain" in payload else None


def set_payload(node: torch.fx.Node, payload: dict[str, Any] | None) -> None:
    """Replace (or with None remove) the tightfit entry of a node, keeping other keys."""
    custom = dict(node.meta.get("custom") or {})
    if payload is None:
        custom.pop(HINT_KEY, None)
    else:
        custom[HINT_KEY] = payload
    if custom:
        node.meta["custom"] = custom
    else:
        node.meta.pop("custom", None)
