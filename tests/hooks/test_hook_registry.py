"""The hook registry: order, stacking, removal that restores ``forward`` exactly, signatures."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from tightfit.hooks import HookRegistry, ModuleHook


class Recorder(ModuleHook):
    def __init__(self, label, log, order=50):
        self.label, self.log, self.order = label, log, order

    def attach(self, module):
        self.log.append(f"attach {self.label}")

    def detach(self, module):
        self.log.append(f"detach {self.label}")

    def pre_forward(self, module, args, kwargs):
        self.log.append(f"pre {self.label}")
        return args, kwargs

    def post_forward(self, module, output):
        self.log.append(f"post {self.label}")
        return output

    def abort(self, module):
        self.log.append(f"abort {self.label}")


class Doubler(ModuleHook):
    def pre_forward(self, module, args, kwargs):
        return (args[0] * 2,), kwargs

    def post_forward(self, module, output):
        return output + 1


def test_hooks_run_by_order_then_registration_and_unwind_in_reverse():
    log = []
    layer = nn.Linear(3, 3)
    registry = HookRegistry.of(layer)
    registry.register("b", Recorder("b", log))
    registry.register("a", Recorder("a", log, order=10))
    registry.register("c", Recorder("c", log))
    assert registry.names() == ["a", "b", "c"] and list(registry) == ["a", "b", "c"] and len(registry) == 3
    log.clear()
    layer(torch.randn(1, 3))
    assert log == ["pre a", "pre b", "pre c", "post c", "post b", "post a"]


def test_hooks_change_arguments_and_output():
    layer = nn.Linear(2, 2)
    x = torch.randn(4, 2)
    expected = layer(2 * x) + 1
    HookRegistry.of(layer).register("double", Doubler())
    assert torch.equal(layer(x), expected)


def test_removal_restores_forward_exactly_and_keeps_the_signature():
    layer = nn.Linear(2, 2)
    before = inspect.signature(layer.forward)
    registry = HookRegistry.of(layer)
    registry.register("one", Doubler())
    registry.register("two", Recorder("two", []))
    assert inspect.signature(layer.forward) == before
    assert layer.forward.__wrapped__ == nn.Linear.forward.__get__(layer)
    registry.remove("two")
    assert "forward" in layer.__dict__
    registry.remove("one")
    assert "forward" not in layer.__dict__ and "_tightfit_hooks" not in layer.__dict__
    assert HookRegistry.get(layer) is None


def test_an_instance_forward_set_before_comes_back():
    layer = nn.Linear(2, 2)

    def custom(x):
        return x

    layer.forward = custom
    registry = HookRegistry.of(layer)
    registry.register("r", Recorder("r", []))
    assert layer(torch.ones(1, 2)).shape == (1, 2)
    registry.remove("r")
    assert layer.__dict__["forward"] is custom


def test_abort_runs_when_forward_raises():
    log = []
    layer = nn.Linear(2, 2)
    registry = HookRegistry.of(layer)
    registry.register("a", Recorder("a", log))
    registry.register("b", Recorder("b", log))
    log.clear()
    with pytest.raises(RuntimeError):
        layer(torch.ones(1, 5))  # wrong width
    assert log == ["pre a", "pre b", "abort b", "abort a"]


class FailingPost(Recorder):
    def post_forward(self, module, output):
        super().post_forward(module, output)
        raise ValueError("post_forward failed")


def test_the_enclosing_hooks_abort_when_a_post_forward_raises():
    log = []
    layer = nn.Linear(2, 2)
    registry = HookRegistry.of(layer)
    registry.register("a", Recorder("a", log, order=10))
    registry.register("b", FailingPost("b", log, order=20))
    registry.register("c", Recorder("c", log, order=30))
    log.clear()
    with pytest.raises(ValueError, match="post_forward failed"):
        layer(torch.ones(1, 2))
    assert log == ["pre a", "pre b", "pre c", "post c", "post b", "abort a"]


def test_a_later_wrapper_is_kept_when_ours_goes():
    layer = nn.Linear(2, 2)
    registry = HookRegistry.of(layer)
    registry.register("d", Doubler())
    ours = layer.forward
    layer.forward = lambda x: ours(x)  # someone wraps after us
    registry.remove("d")
    x = torch.randn(1, 2)
    assert torch.equal(layer(x), nn.Linear.forward(layer, x))  # ours passes straight through now


def test_registry_errors():
    layer = nn.Linear(2, 2)
    registry = HookRegistry.of(layer)
    registry.register("x", Doubler())
    with pytest.raises(ValueError, match="already registered"):
        registry.register("x", Doubler())
    with pytest.raises(ValueError, match="no hook named 'y'"):
        registry.remove("y")
    with pytest.raises(TypeError, match="hook must be ModuleHook"):
        registry.register("z", object())
    with pytest.raises(ValueError, match="non-empty"):
        registry.register("", Doubler())
    with pytest.raises(TypeError, match="module must be Module"):
        HookRegistry.of("layer")
    bad = Doubler()
    bad.order = "first"
    with pytest.raises(TypeError, match="hook.order must be an int"):
        registry.register("w", bad)
    assert "registered" not in repr(registry) and "x" in repr(registry)
