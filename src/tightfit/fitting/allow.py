"""``allow``: what the planner may use, so that a user can rule out, say, quantization."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tightfit.fitting.options import PLACEMENTS, storage_names

__all__ = ["Allow"]


def _names(name: str, value: Any, accepted: tuple[str, ...]) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(
            f"allow {name} must be a set of str, got {type(value).__name__}: {value!r}; accepted: {', '.join(accepted)}"
        )
    names = frozenset(value)
    unknown = sorted(str(n) for n in names if n not in accepted)
    if unknown:
        raise ValueError(
            f"allow {name}={sorted(map(str, names))!r} has {', '.join(map(repr, unknown))}, which is not accepted; "
            f"accepted: {', '.join(accepted)}"
        )
    if not names:
        raise ValueError(f"allow {name} is empty; allow at least one of: {', '.join(accepted)}")
    return names


def _every_storage() -> frozenset[str]:
    return frozenset(storage_names())


@dataclass(frozen=True)
class Allow:
    """Storages (the storage catalogue's formats: ``keep``, ``bfloat16``, ``float8``, ``8bit``, ``int8``,
    ``nf4``, ``fp4`` and any registered since) and placements (``device``, ``cpu``,
    ``disk``) the planner may choose from, and whether it may add region hints (``hints``:
    DFS slicing of the layer stack, which saves memory only under ``torch.compile`` with
    the tightfit backend); everything by default.

    ``keep`` and ``device`` are always allowed: the planner must be able to leave a module
    as it is (norms and biases always are).
    """

    storage: frozenset[str] = field(default_factory=_every_storage)
    placement: frozenset[str] = field(default=frozenset(PLACEMENTS))
    hints: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "storage", _names("storage", self.storage, storage_names()))
        object.__setattr__(self, "placement", _names("placement", self.placement, PLACEMENTS))
        for name, value, needed in (("storage", self.storage, "keep"), ("placement", self.placement, "device")):
            if needed not in value:
                raise ValueError(f"allow {name}={sorted(value)!r} lacks {needed!r}, which is always allowed; add it")
        if not isinstance(self.hints, bool):
            raise TypeError(
                f"allow hints must be a bool, got {type(self.hints).__name__}: {self.hints!r}; accepted: True, False"
            )

    @classmethod
    def parse(cls, text: str) -> Allow:
        """The :class:`Allow` that ``tightfit run --allow`` names: storages and placements
        in one comma-separated list, case and spaces ignored.

        Only the kinds named are restricted: ``int8,nf4`` restricts storages and leaves
        every placement allowed; ``device`` rules out offloading and leaves every storage
        allowed. ``keep`` and ``device`` are always added (the planner must be able to
        leave a unit alone)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str such as 'keep,float8,disk', got {type(text).__name__}: {text!r}")
        storages = storage_names()
        accepted = (
            f"comma-separated names, storages ({', '.join(storages)}) and/or placements ({', '.join(PLACEMENTS)}), "
            f"e.g. 'keep,float8,disk'"
        )
        names = [name.strip().lower() for name in text.split(",") if name.strip()]
        if not names:
            raise ValueError(f"allow={text!r} names nothing; accepted: {accepted}")
        unknown = [name for name in names if name not in storages and name not in PLACEMENTS]
        if unknown:
            raise ValueError(
                f"allow={text!r} has {', '.join(map(repr, unknown))}, which is not accepted; accepted: {accepted}"
            )
        storage = {name for name in names if name in storages}
        placement = {name for name in names if name in PLACEMENTS}
        return cls(
            storage=frozenset(storage | {"keep"}) if storage else frozenset(storages),
            placement=frozenset(placement | {"device"}) if placement else frozenset(PLACEMENTS),
        )

    @classmethod
    def coerce(cls, value: Allow | Mapping[str, Iterable[str]] | str | None) -> Allow:
        """An :class:`Allow` from None (everything), an Allow, a ``--allow`` string
        (:meth:`parse`), or a mapping with keys ``storage``, ``placement`` and/or ``hints``."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if not isinstance(value, Mapping):
            raise TypeError(
                f"allow must be None, a str such as 'keep,float8,disk', an Allow or a dict with keys storage, "
                f"placement and hints, got {type(value).__name__}: {value!r}"
            )
        unknown = sorted(str(k) for k in value if k not in ("storage", "placement", "hints"))
        if unknown:
            raise ValueError(
                f"allow has key(s) {', '.join(map(repr, unknown))}, which is not accepted; "
                f"accepted: 'storage', 'placement', 'hints'"
            )
        return cls(**{key: value[key] for key in value})

    def to_dict(self) -> dict[str, list[str] | bool]:
        return {"storage": sorted(self.storage), "placement": sorted(self.placement), "hints": self.hints}
