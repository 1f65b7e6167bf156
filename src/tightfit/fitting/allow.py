"""``allow``: what the planner may use, so that a user can rule out, say, quantization."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tightfit.fitting.options import PLACEMENTS, STORAGES

__all__ = ["Allow"]


def _names(name: str, value: Any, accepted: tuple[str, ...]) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"allow {name} must be a set of str, got {type(value).__name__}: {value!r}; accepted: {', '.join(accepted)}")
    names = frozenset(value)
    unknown = sorted(str(n) for n in names if n not in accepted)
    if unknown:
        raise ValueError(f"allow {name}={sorted(map(str, names))!r} has {', '.join(map(repr, unknown))}, which is not accepted; "
                         f"accepted: {', '.join(accepted)}")
    if not names:
        raise ValueError(f"allow {name} is empty; allow at least one of: {', '.join(accepted)}")
    return names


@dataclass(frozen=True)
class Allow:
    """Storages (``keep``, ``float8``, ``nf4``, ``fp4``, ``int8``, ``8bit``) and placements
    (``device``, ``cpu``, ``disk``) the planner may choose from, and whether it may add
    region hints (``hints``: DFS slicing of the layer stack, which saves memory only under
    ``torch.compile`` with the tightfit backend); everything by default.

    ``keep`` and ``device`` are always allowed: the planner must be able to leave a module
    as it is (norms and biases always are).
    """

    storage: frozenset[str] = field(default=frozenset(STORAGES))
    placement: frozenset[str] = field(default=frozenset(PLACEMENTS))
    hints: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage", _names("storage", self.storage, STORAGES))
        object.__setattr__(self, "placement", _names("placement", self.placement, PLACEMENTS))
        for name, value, needed in (("storage", self.storage, "keep"), ("placement", self.placement, "device")):
            if needed not in value:
                raise ValueError(f"allow {name}={sorted(value)!r} lacks {needed!r}, which is always allowed; add it")
        if not isinstance(self.hints, bool):
            raise TypeError(f"allow hints must be a bool, got {type(self.hints).__name__}: {self.hints!r}; accepted: True, False")

    @classmethod
    def coerce(cls, value: Allow | Mapping[str, Iterable[str]] | None) -> Allow:
        """An :class:`Allow` from None (everything), an Allow, or a mapping with keys
        ``storage``, ``placement`` and/or ``hints``."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"allow must be None, an Allow or a dict with keys storage, placement and hints, got {type(value).__name__}: {value!r}")
        unknown = sorted(str(k) for k in value if k not in ("storage", "placement", "hints"))
        if unknown:
            raise ValueError(f"allow has key(s) {', '.join(map(repr, unknown))}, which is not accepted; "
                             f"accepted: 'storage', 'placement', 'hints'")
        return cls(**{key: value[key] for key in value})

    def to_dict(self) -> dict[str, list[str] | bool]:
        return {"storage": sorted(self.storage), "placement": sorted(self.placement), "hints": self.hints}
