"""Region hints in a plan: DFS slicing of the layer stack where activations dominate.

``add_hints`` registers a hint hook (:class:`tightfit.hooks.HintHook`) on each
chosen module, so its ``forward`` runs inside ``tightfit.hint(...)`` within the hook
registry's one wrapper, enclosing the module's casting and offloading hooks whatever
order they were applied in; ``remove_hints`` removes those hooks. In eager mode a hint
changes nothing: the saving needs ``torch.compile`` with the tightfit backend
(``Plan.compile``). ``slice_layers`` chooses the fewest slices whose compiled peak,
predicted by ``tightfit.plan_memory(runtime="compiled")``, meets a budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from tightfit._validate import check_type
from tightfit.hints.schema import canonical_hints
from tightfit.hooks import REGION_HINTS, HintHook, HookRegistry

__all__ = ["SLICE_COUNTS", "Sliced", "add_hints", "check_module_hints", "remove_hints", "slice_layers"]

#: Slice counts ``fit`` tries, fewest first (fewer slices: less loop overhead).
SLICE_COUNTS = (2, 4, 8, 16, 32, 64)


def check_module_hints(owner: str, hints: Any) -> dict[str, dict[str, Any]]:
    """``hints`` as {module name: canonical hint dict}, or TypeError/ValueError naming ``owner``."""
    if not isinstance(hints, Mapping):
        raise TypeError(f"{owner} must be a dict of module name -> hint dict, got {type(hints).__name__}: {hints!r}")
    checked = {}
    for name, region in hints.items():
        check_type(f"{owner} key", name, str)
        if not isinstance(region, Mapping):
            raise TypeError(
                f"{owner}[{name!r}] must be a dict of hints (tightfit.hint's keywords), got "
                f"{type(region).__name__}: {region!r}"
            )
        checked[name] = dict(canonical_hints(region))
    return checked


def add_hints(model: nn.Module, hints: Mapping[str, Mapping[str, Any]]) -> nn.Module:
    """Run the ``forward`` of each module named in ``hints`` inside ``tightfit.hint(**its
    hints)`` (a hook in its :class:`~tightfit.hooks.HookRegistry`); returns ``model``. A
    module hinted already is refused."""
    check_type("model", model, nn.Module)
    checked = check_module_hints("hints", hints)
    modules = dict(model.named_modules())
    for name in checked:
        if name not in modules:
            raise ValueError(f"hints names module {name!r}, which model ({type(model).__name__}) does not have")
        if REGION_HINTS in (HookRegistry.get(modules[name]) or ()):
            raise ValueError(f"model's {name!r} has region hints already; remove_hints(model) first")
    for name, region in checked.items():
        HookRegistry.of(modules[name]).register(REGION_HINTS, HintHook(region))
    return model


def remove_hints(model: nn.Module) -> list[str]:
    """Undo :func:`add_hints` on every module of ``model``; returns the names unhinted."""
    check_type("model", model, nn.Module)
    removed = []
    for name, module in model.named_modules():
        registry = HookRegistry.get(module)
        if registry is not None and REGION_HINTS in registry:
            registry.remove(REGION_HINTS)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Sliced:
    """The slicing ``slice_layers`` found: the hints per module, and the compiled plan's
    activation peak with the inputs (bytes) and the node it is at."""

    hints: dict[str, dict[str, Any]]
    activation_bytes: int
    peak_node: str | None


def slice_layers(
    model: nn.Module, args: tuple, kwargs: dict, backend: Any, layers: list[str], device: str, room: int
) -> tuple[Sliced | None, tuple[int, ...], str]:
    """The fewest slices (of :data:`SLICE_COUNTS`, over dimension 0 of each layer's input)
    whose compiled activation peak with the inputs is <= ``room``, the counts whose
    prediction was made, and why the search stopped short ("" when it did not). The
    search stops once more slices stop lowering the peak. Each count is planned under
    strict mode, so a region the slicing proof refuses (a hint the backend would ignore)
    stops the search instead of counting as a saving."""
    from tightfit._errors import StrictModeError
    from tightfit._strict import strict
    from tightfit.memory import plan_memory

    tried: list[int] = []
    previous = None
    for slices in SLICE_COUNTS:
        hints = {name: {"schedule": "dfs", "slices": slices, "slice_dim": 0} for name in layers}
        add_hints(model, hints)
        try:
            with strict():
                # the written order: what plan.compile's FX execution runs (a "best" order would predict a reordering it never makes)
                memory = plan_memory(model, *args, kwargs=kwargs, backend=backend, runtime="compiled", order="written")
        except StrictModeError as error:
            return None, tuple(tried), str(error)
        finally:
            remove_hints(model)
        tried.append(slices)
        planned = memory.devices.get(device)
        activations = planned.live_peak_bytes + planned.inputs_bytes if planned else 0
        if activations <= room:
            return Sliced(hints, activations, planned.peak_node if planned else None), tuple(tried), ""
        if previous is not None and activations >= previous:  # more slices than the dimension has, or no gain left
            break
        previous = activations
    return None, tuple(tried), ""
