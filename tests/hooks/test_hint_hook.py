"""Region hints go through the hook registry: a module with hints, layerwise casting and
offloading has one ``forward`` wrapper, and the hint region encloses the other two hooks
whatever order they were applied in (before, a hint wrapper applied first ended up inside
the registry's wrapper, and one applied last outside it)."""

from __future__ import annotations

import pytest
import torch
import torch.fx.traceback as fx_traceback

import tightfit
from tightfit.fitting import add_hints, remove_hints
from tightfit.hints import HINT_KEY
from tightfit.hooks import (
    LAYERWISE_CASTING,
    OFFLOADING,
    REGION_HINTS,
    HookRegistry,
    LayerwiseCastingHook,
    OffloadHook,
    apply_layerwise_casting,
    apply_offloading,
    remove_layerwise_casting,
    remove_offloading,
)
from zoo.hooks import stack

HINTS = {"0": {"schedule": "dfs", "slices": 2}, "1": {"schedule": "dfs", "slices": 2}}
STEPS = {
    "hints": lambda model: add_hints(model, HINTS),
    "casting": lambda model: apply_layerwise_casting(
        model, torch.float8_e4m3fn, torch.float32, granularity="block", skip=()
    ),
    "offloading": lambda model: apply_offloading(model, "cpu", offload_to="cpu", granularity="block"),
}
# casting refuses an offloaded module, so it comes before offloading; the hints go anywhere
ORDERS = [("hints", "casting", "offloading"), ("casting", "hints", "offloading"), ("casting", "offloading", "hints")]


def _in_region() -> bool:
    return HINT_KEY in (fx_traceback.current_meta.get("custom") or {})


@pytest.fixture
def log(monkeypatch):
    """(hook, phase, inside a hint region) for every casting and offloading hook call."""
    calls = []
    for cls, label in ((LayerwiseCastingHook, "casting"), (OffloadHook, "offloading")):
        for phase in ("pre_forward", "post_forward"):
            original = getattr(cls, phase)

            def probe(self, module, *rest, _original=original, _label=label, _phase=phase):
                calls.append((_label, _phase, _in_region()))
                return _original(self, module, *rest)

            monkeypatch.setattr(cls, phase, probe)
    return calls


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(order) for order in ORDERS])
def test_hint_region_encloses_casting_and_offloading_whatever_the_order(order, log):
    model = stack(width=16, depth=2)
    x = torch.randn(4, 16)
    for step in order:
        STEPS[step](model)
    block = model[0]
    assert HookRegistry.get(block).names() == [REGION_HINTS, OFFLOADING, LAYERWISE_CASTING]
    assert block.__dict__["forward"].func.__name__ == "_hooked_forward"  # the registry's wrapper, and only it
    seen = []
    block.register_forward_hook(lambda *_: seen.append(_in_region()))  # runs after the hooked forward returns
    model(x)
    assert log[:4] == [
        ("offloading", "pre_forward", True),
        ("casting", "pre_forward", True),
        ("casting", "post_forward", True),
        ("offloading", "post_forward", True),
    ]
    assert seen == [False] and not _in_region()  # the region closed when the block returned
    assert remove_hints(model) == ["0", "1"]
    remove_offloading(model)
    remove_layerwise_casting(model)
    assert "forward" not in block.__dict__ and HookRegistry.get(block) is None


def test_compiled_graph_has_the_casts_inside_the_region():
    """Under torch.compile the hint hook's region (entered in the registry's wrapper) is
    traced in one graph, and it covers the upcasts the casting hook adds."""
    model = stack(width=16, depth=1)
    add_hints(model, {"0": {"order": "as_written"}})  # applied first: it still encloses the casting
    apply_layerwise_casting(model, torch.float8_e4m3fn, torch.float32, granularity="block", skip=())
    regions = []

    def backend(graph_module, example_inputs):
        regions.extend(tightfit.hints_of(graph_module))
        casts = [node.name for node in graph_module.graph.nodes if node.target is torch.ops.tightfit.cast.default]
        regions.append(casts)
        return graph_module.forward

    x = torch.randn(4, 16)
    expected = model(x)
    got = torch.compile(model, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(got, expected)
    *found, casts = regions
    assert [dict(region.hints) for region in found] == [{"order": "as_written"}]
    assert casts and set(casts) <= set(found[0].nodes)
    remove_hints(model)
    remove_layerwise_casting(model)
