"""Assignment (which backend runs each op) and splits with a restricted backend: the scheduler must split, copy and fall back."""

from __future__ import annotations

import warnings

import pytest
import torch

import tightfit
from tightfit.backends.cpu import CPUBackend
from tightfit.graph.assign import unsupported_reason
from tightfit.graph.honor import HintLedger
from zoo.graph import devices, fx_compile, restricted, restricted_cpu, run_recording


class TwoLayers(torch.nn.Module):
    def __init__(self, hinted_device: str | None = None) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.hinted_device = hinted_device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).softmax(-1)
        if self.hinted_device is None:
            h = h.relu() * 2
        else:
            with tightfit.hint(device=self.hinted_device):
                h = h.relu() * 2
        return self.b(h)


def _backends(device: str):
    """A restricted backend for ``device`` that refuses softmax, and the CPU as the fallback."""
    if device == "cpu":
        return [restricted_cpu(), CPUBackend()]
    from tightfit.backends.cuda import CUDABackend

    return [
        restricted(CUDABackend, frozenset({"aten::_softmax", "aten::_softmax_backward_data"}), "cuda-restricted"),
        CPUBackend(),
    ]


@pytest.mark.parametrize("device", devices())
def test_unsupported_ops_split_the_graph_and_fall_back_to_the_cpu_warning_once(device):
    torch.manual_seed(0)
    model = TwoLayers().to(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    expected = model(x)
    expected.sum().backward()
    expected_grad = x.grad.clone()
    x.grad = None
    compiled = fx_compile(model, backends=_backends(device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (out, ran) = run_recording(lambda: compiled(x))
        out.sum().backward()
        compiled(x)  # a second run warns no more
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, expected_grad)
    names = [split.backend.name for split in ran]
    restricted_name = _backends(device)[0].name
    assert names == [restricted_name, "cpu", restricted_name]
    assert ran[1].device.type == "cpu"
    if device != "cpu":
        assert ran[1].copies and ran[2].copies  # to the CPU and back
    messages = [str(w.message) for w in caught if issubclass(w.category, tightfit.FallbackWarning)]
    assert len(messages) == 2, messages  # once per op: softmax forward, softmax backward
    assert (
        f"tightfit op 'aten::_softmax' on {restricted_name}: {restricted_name} declares aten::_softmax unsupported; running it on backend cpu"
        in messages[0]
    )


def test_cpu_fallback_is_an_error_in_strict_mode():
    compiled = fx_compile(TwoLayers(), backends=_backends("cpu"))
    with tightfit.strict(), pytest.raises(Exception) as raised, torch.no_grad():
        compiled(torch.randn(4, 16))
    assert isinstance(getattr(raised.value, "inner_exception", None), tightfit.StrictModeError)
    assert "strict mode forbids fallbacks" in str(raised.value)


def test_device_hint_assigns_a_region_to_the_named_backend():
    model = TwoLayers(hinted_device="cpu")
    compiled = fx_compile(model, backends=[restricted(CPUBackend, frozenset(), "cpu-first"), CPUBackend()])
    x = torch.randn(4, 16)
    with torch.no_grad():
        out, ran = run_recording(lambda: compiled(x))
        torch.testing.assert_close(out, model(x))
    assert [split.backend.name for split in ran] == ["cpu-first", "cpu", "cpu-first"]
    assert {node.target.__name__.split(".")[0] for node in ran[1].nodes} >= {"relu", "mul"}


def test_a_device_hint_naming_no_backend_is_ignored_with_a_reason(caplog):
    model = TwoLayers(hinted_device="npu")
    with torch.no_grad():
        out, ran = run_recording(lambda: fx_compile(model)(torch.randn(2, 16)))
    assert len(ran) == 1
    assert "hint device='npu'" in caplog.text and "not known" in caplog.text


def test_unsupported_reasons_name_ops_and_dtypes():
    graph = torch.fx.symbolic_trace(lambda x: x.softmax(-1))
    node = next(n for n in graph.graph.nodes if n.op == "call_method")
    node.target = torch.ops.aten._softmax.default
    node.meta["val"] = torch.empty(2, dtype=torch.float64, device="meta")
    ledger = HintLedger("test")
    assert unsupported_reason(restricted_cpu(), ledger, node) == "cpu-restricted declares aten::_softmax unsupported"
    assert unsupported_reason(CPUBackend(), ledger, node) is None

    class NoDouble(CPUBackend):
        name = "no-double"

        def _capabilities(self):
            caps = super()._capabilities()
            return type(caps)(storage_dtypes=caps.storage_dtypes, compute_dtypes=caps.compute_dtypes - {torch.float64})

    assert unsupported_reason(NoDouble(), ledger, node) == "no-double cannot compute in torch.float64"
