"""Which modules get a hook (units) and which tensors each one handles (slots). Private.

A *slot* is one entry of a module's ``_parameters`` or ``_buffers``. Hooks swap what a
slot holds for the length of a forward (an on-device copy, an upcast copy) and put the
stored tensor back afterwards, so the module's own code never changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from tightfit._validate import check_type

__all__: list[str] = []

GRANULARITIES = ("leaf", "block", "model")

#: Modules whose ``forward`` reads the weights of child modules without calling them:
#: a unit at such a module covers its whole subtree.
_READS_CHILD_WEIGHTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)

Granularity = str | Callable[[str, nn.Module], bool]


@dataclass(eq=False)
class Slot:
    """``owner._parameters[name]`` or ``owner._buffers[name]``."""

    owner: nn.Module
    name: str
    is_parameter: bool

    @property
    def table(self) -> dict:
        return self.owner._parameters if self.is_parameter else self.owner._buffers

    def get(self) -> torch.Tensor:
        return self.table[self.name]

    def set(self, value: torch.Tensor) -> None:
        self.table[self.name] = value


@dataclass(eq=False)
class Unit:
    """A module that gets a hook, with the slots its hook handles."""

    name: str
    module: nn.Module
    slots: list[Slot]
    members: list[nn.Module] = field(default_factory=list)  # the modules whose forwards use the slots; [module] alone

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [self.module]


def own_slots(module: nn.Module) -> list[Slot]:
    """The module's direct parameters and buffers (not its children's)."""
    slots = [Slot(module, name, True) for name, value in module._parameters.items() if value is not None]
    return slots + [Slot(module, name, False) for name, value in module._buffers.items() if value is not None]


def compile_patterns(name: str, patterns: object) -> tuple[re.Pattern, ...]:
    """A tuple of regexes from a str or a sequence of str, each checked to compile."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    if not isinstance(patterns, (tuple, list)):
        raise TypeError(
            f"{name} must be a str or a tuple of str (regular expressions), got {type(patterns).__name__}: {patterns!r}"
        )
    compiled = []
    for pattern in patterns:
        check_type(f"{name} entry", pattern, str)
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise ValueError(f"{name} entry {pattern!r} is not a valid regular expression: {error}") from None
    return tuple(compiled)


def check_granularity(granularity: object) -> None:
    if callable(granularity):
        return
    if not isinstance(granularity, str):
        raise TypeError(
            f"granularity must be one of {', '.join(GRANULARITIES)} or a callable (name, module) -> bool, "
            f"got {type(granularity).__name__}: {granularity!r}"
        )
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity={granularity!r} is not accepted; accepted: {', '.join(GRANULARITIES)} or a callable (name, module) -> bool"
        )


class _Walk:
    """What picks units and slots: patterns that skip modules (names and class names) and
    tensors (qualified names), with the names of the tensors they kept out."""

    def __init__(self, skip: tuple[re.Pattern, ...], skip_names: tuple[re.Pattern, ...]) -> None:
        self.skip = skip
        self.skip_names = skip_names
        self.kept: list[str] = []

    def skipped(self, name: str, module: nn.Module) -> bool:
        """A ``skip`` pattern in the module's qualified name or class name, or a ``skip_names`` one in its name."""
        if not name:
            return False  # the root
        return any(p.search(name) or p.search(type(module).__name__) for p in self.skip) or any(
            p.search(name) for p in self.skip_names
        )

    def own(self, name: str, module: nn.Module) -> list[Slot]:
        """The module's own slots but those whose qualified name a pattern finds (a bare parameter)."""
        slots = []
        for slot in own_slots(module):
            qualified = f"{name}.{slot.name}" if name else slot.name
            if any(p.search(qualified) for p in self.skip + self.skip_names):
                self.kept.append(qualified)
            else:
                slots.append(slot)
        return slots

    def subtree(self, name: str, module: nn.Module) -> list[Slot]:
        slots = self.own(name, module)
        for child_name, child in _children(name, module):
            if not self.skipped(child_name, child):
                slots += self.subtree(child_name, child)
        return slots


def _children(name: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for child_name, child in module.named_children():
        yield (f"{name}.{child_name}" if name else child_name), child


def select_units(
    root: nn.Module,
    granularity: Granularity,
    skip: tuple[re.Pattern, ...],
    *,
    skip_names: tuple[re.Pattern, ...] = (),
    blocks_per_unit: int = 1,
    kept: list[str] | None = None,
) -> list[Unit]:
    """The units under ``root`` (root included) in module order; skipped subtrees get none.

    ``leaf``: every module owning tensors directly. ``block``: every element of the first
    ``nn.ModuleList`` / ``nn.Sequential`` on each branch covers its subtree (``blocks_per_unit``
    consecutive elements make one unit, named ``first+...+last``); modules outside such
    lists are leaves. ``model``: ``root`` covers everything. A callable picks modules that
    each cover their subtree. ``skip`` patterns are searched in qualified names and class
    names, ``skip_names`` ones in qualified names only; a tensor whose qualified name
    either finds (a bare parameter such as ``blocks.0.scale_shift_table``) is left out
    of its unit, and its name appended to ``kept``.
    """
    units: list[Unit] = []
    seen: set[int] = set()
    walker = _Walk(skip, skip_names)

    def add(name: str, module: nn.Module, slots: list[Slot], members: list[nn.Module] | None = None) -> None:
        if slots and id(module) not in seen:
            seen.add(id(module))
            units.append(Unit(name, module, slots, members or []))

    def walk(name: str, module: nn.Module, in_list: bool) -> None:
        if walker.skipped(name, module):
            return
        if callable(granularity):
            if granularity(name, module):
                add(name, module, walker.subtree(name, module))
                return
        elif granularity == "model" or (granularity == "block" and in_list) or isinstance(module, _READS_CHILD_WEIGHTS):
            add(name, module, walker.subtree(name, module))
            return
        elif granularity in ("leaf", "block"):
            add(name, module, walker.own(name, module))
        is_list = granularity == "block" and isinstance(module, (nn.ModuleList, nn.Sequential))
        if is_list and blocks_per_unit > 1:
            blocks = [(n, c) for n, c in _children(name, module) if not walker.skipped(n, c)]
            for start in range(0, len(blocks), blocks_per_unit):
                group = blocks[start : start + blocks_per_unit]
                slots = [slot for n, c in group for slot in walker.subtree(n, c)]
                add("+".join(n for n, _ in group), group[0][1], slots, [c for _, c in group])
            return
        for child_name, child in _children(name, module):
            walk(child_name, child, is_list)

    walk("", root, False)
    if kept is not None:
        kept.extend(walker.kept)
    return units


def all_slots(root: nn.Module) -> list[Slot]:
    """Every parameter and buffer slot in the tree, shared modules once."""
    return [slot for module in root.modules() for slot in own_slots(module)]
