"""The "tightfit" torch.compile backend: registration, options, honored hints, execution."""

from __future__ import annotations

import logging
import subprocess
import sys
from functools import partial

import pytest
import torch

import tightfit
from tightfit.backends import RUNTIME_HINTS
from tightfit.backends.cpu import CPUBackend
from tightfit.graph import CompileOptions, compiler
from zoo.commands import side_by_side
from zoo.graph import Attention, fx_compile, run_recording

#: Fresh processes: the backend found by name after a plain import, and after dynamo was imported first.
PROBES = {
    "by name": (
        "import torch, tightfit, torch._dynamo\n"
        "assert 'tightfit' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "f = torch.compile(lambda x: x.sin() + 1, backend='tightfit', options={'execution': 'fx'})\n"
        "x = torch.randn(5)\n"
        "assert torch.equal(f(x), x.sin() + 1)\n"
        "print('ok')\n"
    ),
    "dynamo first": "import torch._dynamo, torch, tightfit\nassert 'tightfit' in torch._dynamo.list_backends()\nprint('ok')\n",
}


def _probe(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def probes():
    """The PROBES, started side by side."""
    with side_by_side({name: partial(_probe, code) for name, code in PROBES.items()}) as runs:
        yield runs


def test_backend_is_registered_by_name_without_an_installed_entry_point(probes):
    done = probes["by name"].result()
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_registration_after_dynamo_is_already_imported(probes):
    done = probes["dynamo first"].result()
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_cpu_backend_declares_the_hints_it_honors():
    assert CPUBackend().capabilities().hints == RUNTIME_HINTS == {"schedule", "slices", "slice_dim", "device", "order"}


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"execution": "jit"}, ValueError, "execution='jit' is not accepted; accepted: auto, fx, inductor"),
        ({"execution": 1}, TypeError, "execution must be str"),
        ({"backends": []}, ValueError, "at least one backend"),
        ({"backends": ["cpu"]}, TypeError, "backends[0] must be Backend"),
        ({"backends": "cpu"}, TypeError, "backends must be tuple or list"),
    ],
)
def test_bad_options_are_rejected_when_the_backend_is_made(kwargs, error, words):
    with pytest.raises(error) as raised:
        compiler(**kwargs)
    assert words in str(raised.value)


def test_bad_torch_compile_options_are_rejected_at_first_compile():
    with pytest.raises(ValueError, match=r"options \['fast'\] are not accepted"):
        CompileOptions.from_options({"fast": True})
    compiled = torch.compile(lambda x: x + 1, backend="tightfit", options={"execution": "nope"})
    with pytest.raises(Exception) as raised:
        compiled(torch.ones(2))
    assert isinstance(raised.value.inner_exception, ValueError)


def test_a_hint_the_backend_does_not_honor_is_ignored_with_one_debug_line(caplog):
    def fn(x):
        with tightfit.hint(stream="side", **{"acme.tile": 8}):
            return x.relu() * 2

    x = torch.randn(8)
    with caplog.at_level(logging.DEBUG, logger="tightfit.graph"):
        torch.testing.assert_close(fx_compile(fn)(x), x.relu() * 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "tightfit.graph" and r.levelno == logging.DEBUG]
    assert sum("hint stream='side'" in line and "not honored by backend cpu; ignored" in line for line in lines) == 1, (
        lines
    )
    assert sum("hint acme.tile=8" in line for line in lines) == 1, lines


def test_a_hint_the_backend_does_not_honor_is_an_error_in_strict_mode():
    def fn(x):
        with tightfit.hint(stream="side"):
            return x.relu()

    with tightfit.strict(), pytest.raises(Exception) as raised:
        fx_compile(fn)(torch.randn(3))
    assert isinstance(raised.value.inner_exception, tightfit.StrictModeError)
    assert "not honored by backend cpu" in str(raised.value)


class AcmeBackend(CPUBackend):
    """A vendor backend (on the CPU) with its own split compiler that reads its own hints."""

    name = "acme"
    priority = 10

    def __init__(self) -> None:
        self.seen: list[object] = []

    def _capabilities(self):
        caps = super()._capabilities()
        return type(caps)(**{**caps.__dict__, "hints": caps.hints | {"acme.tile"}})

    def _compile_split(self, graph_module, example_inputs):
        self.seen.extend(region.hints.get("acme.tile") for region in tightfit.hints_of(graph_module))
        return graph_module.forward


def test_a_vendor_backend_compiles_splits_and_reads_its_namespaced_hints(caplog):
    def fn(x):
        with tightfit.hint(**{"acme.tile": 64}):
            return x.cos() + 1

    acme = AcmeBackend()
    x = torch.randn(4)
    with caplog.at_level(logging.DEBUG, logger="tightfit.graph"):
        out, ran = run_recording(lambda: torch.compile(fn, backend=compiler(backends=[acme]))(x))
    torch.testing.assert_close(out, x.cos() + 1)
    assert acme.seen == [64]
    assert [split.backend.name for split in ran] == ["acme"]
    assert "acme.tile" not in caplog.text  # honored: no "ignored" line


def test_order_as_written_region_runs_as_an_fx_module(monkeypatch):
    from tightfit.graph import inductor

    compiled_nodes = []
    monkeypatch.setattr(
        inductor, "compile_split", lambda gm, examples: compiled_nodes.append(len(gm.graph.nodes)) or gm.forward
    )

    def fn(x):
        y = x.sin()
        with tightfit.hint(order="as_written"):
            z = y.exp() * 2
        return z + 1

    x = torch.randn(4)
    with torch.no_grad():
        out, ran = run_recording(lambda: torch.compile(fn, backend="tightfit")(x))
    torch.testing.assert_close(out, (x.sin().exp() * 2) + 1)
    assert [split.as_written for split in ran] == [False, True, False]
    assert len(compiled_nodes) == 2  # the two splits around the region; the region is not compiled


def test_debug_sched_prints_every_split_and_why(monkeypatch, capsys):
    monkeypatch.setenv("TIGHTFIT_DEBUG", "sched")
    model = Attention(hints={"schedule": "dfs", "slices": 4, "slice_dim": 1})
    with torch.no_grad():
        fx_compile(model)(torch.randn(1, 8, 32))
    err = capsys.readouterr().err
    assert "tightfit sched: inference graph, 3 split(s), 0 copied input(s)" in err
    assert "split 1: backend cpu on cpu, dfs: 4 slices of dim 1 (8 elements)" in err
    assert "data on cpu: highest-priority backend for cpu" in err
    assert "a view of" in err


def test_a_bad_debug_setting_is_rejected(monkeypatch):
    monkeypatch.setenv("TIGHTFIT_DEBUG", "schedule")
    with pytest.raises(Exception) as raised:
        fx_compile(lambda x: x + 1)(torch.ones(2))
    assert "TIGHTFIT_DEBUG='schedule' is not accepted" in str(raised.value)


def test_inductor_runs_plain_and_sliced_splits():
    torch.manual_seed(0)
    model = Attention(embed=16, heads=4, hints={"schedule": "dfs", "slices": 2, "slice_dim": 1})
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        out, ran = run_recording(lambda: torch.compile(model, backend=compiler(execution="inductor"))(x))
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
    assert [split.plan is not None for split in ran] == [False, True, False]


def test_where_inductor_cannot_compile_splits_run_as_fx_warning_once(monkeypatch):
    from tightfit.graph import inductor

    def broken(graph_module, examples):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(inductor, "compile_split", broken)
    x = torch.randn(4)
    with pytest.warns(
        tightfit.FallbackWarning, match="inductor could not compile a split for cpu .*no C\\+\\+ compiler"
    ):
        with torch.no_grad():
            out, ran = run_recording(lambda: torch.compile(lambda t: t.cos() * 2, backend="tightfit")(x))
    torch.testing.assert_close(out, x.cos() * 2)
    with pytest.raises(Exception) as raised:
        torch.compile(lambda t: t.sin(), backend=compiler(execution="inductor"))(x)
    assert "execution='inductor'" in str(raised.value) and "no C++ compiler" in str(raised.value)
