"""A hooked module runs one forward at a time: a second thread entering it meanwhile gets
a clear error and the first goes on undisturbed; one thread after another is fine."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from tightfit.hooks import apply_layerwise_casting, apply_offloading, remove_layerwise_casting, remove_offloading
from zoo.hooks import same_state, snapshot

F8 = torch.float8_e4m3fn


class Pausing(nn.Linear):
    """A Linear whose forward waits, when asked, until the test lets it go on."""

    pause = None

    def forward(self, x):
        if self.pause is not None:
            self.pause()
        return super().forward(x)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), Pausing(16, 16), nn.Linear(16, 16)).eval()


HOOKS = {
    "casting": (
        lambda m, path: apply_layerwise_casting(m, F8, torch.float32, keep_originals=True),
        remove_layerwise_casting,
    ),
    "offload to disk": (lambda m, path: apply_offloading(m, "cpu", offload_to="disk", path=path), remove_offloading),
    "offload to cpu": (lambda m, path: apply_offloading(m, "cpu"), remove_offloading),
}


@pytest.mark.parametrize(
    "hooks", [["casting"], ["offload to disk"], ["offload to cpu"], ["casting", "offload to disk"]]
)
def test_a_second_thread_inside_a_hooked_module_raises_and_the_first_goes_on(tmp_path, hooks):
    layers = model()
    x = torch.randn(2, 16)
    saved = snapshot(layers)
    for name in hooks:
        HOOKS[name][0](layers, tmp_path)
    with torch.no_grad():
        expected = layers(x)
    inside, go_on, results = threading.Event(), threading.Event(), {}

    def pause():
        inside.set()
        go_on.wait(30)

    def first():
        with torch.no_grad():
            results["first"] = layers(x)

    layers[1].pause = pause
    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(
            RuntimeError,
            match=r"is running a forward in another thread \(tightfit\..*\): a module with "
            r"tightfit hooks runs one forward at a time",
        ):
            layers(x)
    finally:
        go_on.set()
        thread.join(30)
    layers[1].pause = None
    assert torch.equal(results["first"], expected)  # undisturbed
    second = threading.Thread(target=first)  # one thread after another: fine
    second.start()
    second.join(30)
    assert torch.equal(results["first"], expected) and torch.equal(layers(x), expected)
    for name in reversed(hooks):
        HOOKS[name][1](layers)
    assert same_state(layers, saved)  # no copy left behind
