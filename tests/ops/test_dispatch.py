"""Dispatch machinery: the reference fallback warns once per (op, device), strict mode
raises, an op that cannot run on its device runs on the CPU with copies."""

from __future__ import annotations

import warnings

import pytest
import torch

import tightfit
from tightfit.ops._registry import Case, define_op, register_kernel

CASES = lambda: [Case("small", (torch.arange(5.0),))]  # noqa: E731 - a one-line case table


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _double_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _fill_reference(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x + 1)


DOUBLE = define_op("test_double", _double, fake=_double_fake, cases=CASES)
UNSUPPORTED_ON = {"device": None}
FILL = define_op(
    "test_fill_off_device",
    _fill_reference,
    fake=lambda x, out: None,
    cases=lambda: [],
    mutates_args=("out",),
    unsupported=lambda device, args: (
        "pretend this device lacks the op" if device.type == UNSUPPORTED_ON["device"] else None
    ),
)


def fallback_warnings(record):
    return [w for w in record if issubclass(w.category, tightfit.FallbackWarning)]


def test_reference_fallback_warns_once_per_op_and_device():
    x = torch.arange(4.0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = DOUBLE(x)
        second = DOUBLE(x)
    assert torch.equal(first, x * 2) and torch.equal(second, x * 2)
    found = fallback_warnings(record)
    assert len(found) == 1
    assert "'test_double' on cpu" in str(found[0].message) and "reference" in str(found[0].message)


def test_strict_context_raises_naming_op_and_device():
    with tightfit.strict(), pytest.raises(tightfit.StrictModeError, match="'test_double' on cpu"):
        DOUBLE(torch.ones(3))
    with tightfit.strict(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DOUBLE(torch.ones(3))  # explicitly off inside the block


def test_strict_environment_variable(monkeypatch):
    monkeypatch.setenv("TIGHTFIT_STRICT", "1")
    assert tightfit.is_strict()
    with pytest.raises(tightfit.StrictModeError):
        DOUBLE(torch.ones(3))


def test_strict_rejects_non_bool():
    with pytest.raises(TypeError, match="enabled must be bool"):
        with tightfit.strict("yes"):
            pass


def test_registered_kernel_replaces_the_reference_without_warning():
    def triple(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    op = define_op("test_triple", triple, fake=_double_fake, cases=CASES)
    register_kernel("test_triple", "cpu", lambda x: x + x + x, label="sum of three")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tightfit.FallbackWarning)
        assert torch.equal(op(torch.arange(3.0)), torch.tensor([0.0, 3.0, 6.0]))
    assert tightfit.ops.get_op("test_triple").kernels["cpu"].label == "sum of three"


def test_later_registration_overrides_earlier():
    def plus_one(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    op = define_op("test_override", plus_one, fake=_double_fake, cases=CASES)
    register_kernel("test_override", "cpu", lambda x: x + 10)
    register_kernel("test_override", "cpu", lambda x: x + 100)
    assert op(torch.zeros(1)).item() == 100.0


def test_unsupported_device_runs_on_cpu_with_copies_and_mutations_back(monkeypatch):
    monkeypatch.setitem(UNSUPPORTED_ON, "device", "cpu")
    x = torch.arange(3.0)
    out = torch.zeros(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        FILL(x, out)
    assert torch.equal(out, x + 1)
    messages = [str(w.message) for w in fallback_warnings(record)]
    assert messages == [
        "tightfit op 'test_fill_off_device' on cpu: the op cannot run on cpu (pretend this device lacks the op); running it on the CPU with copies"
    ]
    with tightfit.strict(), pytest.raises(tightfit.StrictModeError, match="cannot run on cpu"):
        FILL(x, out)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: tightfit.ops.get_op(5), TypeError, "op must be str"),
        (lambda: tightfit.ops.get_op("nonesuch"), ValueError, "op 'nonesuch' is not registered"),
        (lambda: register_kernel("cast", "cuda:0", lambda x, d: x), ValueError, "device_type must be a device type"),
        (lambda: register_kernel("cast", "", lambda x, d: x), ValueError, "device_type must be a device type"),
        (lambda: register_kernel("cast", "cuda", "not callable"), TypeError, "fn must be callable"),
        (
            lambda: register_kernel("cast", "warpdrive", lambda x, d: x),
            ValueError,
            "not a device type torch knows.*PrivateUse1",
        ),
        (
            lambda: define_op("test_double", _double, fake=_double_fake, cases=CASES),
            ValueError,
            "op 'test_double' is already defined",
        ),
    ],
)
def test_registry_rejects_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_strict_environment_rejects_unknown_values(monkeypatch, value):
    monkeypatch.setenv("TIGHTFIT_STRICT", value)
    with pytest.raises(ValueError, match=f"TIGHTFIT_STRICT='{value}' is not accepted; accepted: 0, 1, false"):
        tightfit.is_strict()


def test_define_op_rejects_mutated_argument_that_does_not_exist():
    with pytest.raises(ValueError, match="mutates_args names 'out', which is not a parameter"):
        define_op("test_no_out", _double, fake=_double_fake, cases=CASES, mutates_args=("out",))


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_plain_calls_skip_the_dispatcher_and_everything_else_goes_through_it():
    calls = []
    op = define_op("test_direct", _double, fake=_double_fake, cases=CASES)
    register_kernel("test_direct", "cpu", lambda x: calls.append(type(x)) or x * 2)
    x = torch.arange(3.0)
    assert torch.equal(op(x), x * 2) and calls == [torch.Tensor]
    assert torch.equal(op(torch.nn.Parameter(x)), x * 2)  # a Parameter counts as plain
    with _RecordOps() as mode:  # a dispatch mode must see the op
        op(x)
    assert "tightfit.test_direct.default" in mode.ops
    leaf = x.clone().requires_grad_()
    recorded = op(leaf)  # autograd sees the op, which has no backward formula
    with pytest.raises(RuntimeError):
        recorded.sum().backward()
    with torch.no_grad():
        assert torch.equal(op(leaf), x * 2)
