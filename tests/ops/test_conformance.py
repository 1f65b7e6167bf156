"""The conformance harness: every op passes on every available backend, and the harness
itself catches wrong values and writes past an output's end."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tightfit
from tightfit.ops._registry import Case, define_op, register_kernel
from tightfit.ops.conformance import SENTINEL_BYTE, run_checks

IN_TREE_OPS = sorted(name for name in tightfit.ops.registered_ops() if not name.startswith("test_"))


@pytest.mark.parametrize("op", IN_TREE_OPS)
def test_every_op_conforms_on_every_available_backend(op):
    results = run_checks(ops=[op])
    assert results, "no checks ran"
    failures = [r for r in results if r.status == "FAIL"]
    assert not failures, failures
    backends_checked = {r.backend for r in results}
    assert {b.name for b in tightfit.backends.available()} <= backends_checked
    assert any(r.kernel.startswith("direct") for r in results)  # the CPU kernel called directly too


def _copy_reference(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


def _overrunning_kernel(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)
    whole = torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage())
    whole[-1] = 0  # one byte past the end of out


def _wrong_kernel(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x + 1)


CASES = lambda: [Case("nine", (torch.arange(9.0), torch.empty(9)))]  # noqa: E731
define_op("test_overrun", _copy_reference, fake=lambda x, out: None, cases=CASES, mutates_args=("out",))
register_kernel("test_overrun", "cpu", _overrunning_kernel)
define_op("test_wrong", _copy_reference, fake=lambda x, out: None, cases=CASES, mutates_args=("out",))
register_kernel("test_wrong", "cpu", _wrong_kernel)


def test_sentinel_catches_writes_past_the_output():
    assert SENTINEL_BYTE != 0
    results = run_checks(ops=["test_overrun"], backends=[tightfit.backends.get("cpu")])
    assert results and all(r.status == "FAIL" for r in results)
    assert "sentinel bytes changed" in results[0].detail


def test_wrong_values_fail_with_a_count():
    results = run_checks(ops=["test_wrong"], backends=[tightfit.backends.get("cpu")])
    assert results and all(r.status == "FAIL" for r in results)
    assert "bytes differ" in results[0].detail


def _negated_nan_kernel(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.where(torch.isnan(x), -x, x))  # the same NaNs, sign bit flipped


NAN_CASES = lambda: [Case("nans", (torch.tensor([1.0, float("nan"), -float("nan"), 2.0]), torch.empty(4)))]  # noqa: E731
define_op("test_nan_sign", _copy_reference, fake=lambda x, out: None, cases=NAN_CASES, mutates_args=("out",))
register_kernel("test_nan_sign", "cpu", _negated_nan_kernel)


def test_bitwise_ignores_nan_signs_and_payloads_but_nothing_else():
    results = run_checks(ops=["test_nan_sign"], backends=[tightfit.backends.get("cpu")])
    assert results and all(r.status == "OK" for r in results)
    from tightfit.ops.conformance import _compare

    assert (
        _compare(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), -1.0]), "bitwise")
        == "output 0: 4 of 8 bytes differ"
    )


def test_run_checks_rejects_unknown_ops():
    with pytest.raises(ValueError, match="op 'nonesuch' is not registered"):
        run_checks(ops=["nonesuch"])


def test_cli_check_prints_table_and_count():
    done = subprocess.run(
        [sys.executable, "-m", "tightfit.app.cli", "check", "--op", "cast"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    passed, total = summary.split()[0].split("/")
    assert int(passed) == int(total) > 0 and "0 failed" in summary


def test_run_checks_rejects_a_bare_string_and_non_backends():
    with pytest.raises(TypeError, match="ops must be a list of op names"):
        run_checks(ops="cast")
    with pytest.raises(TypeError, match="backends must hold tightfit Backend objects"):
        run_checks(ops=["cast"], backends=["cpu"])


def test_run_checks_with_no_backends_still_checks_the_cpu_kernel():
    results = run_checks(ops=["cast"], backends=[])
    assert results and {r.kernel.split()[0] for r in results} == {"direct"}
    assert all(r.status == "OK" for r in results)


def test_each_op_is_a_progress_task_counting_its_checks():
    """``tightfit check`` shows each op's progress while it runs; a library caller sees none."""
    import io

    from rich.console import Console

    from tightfit._progress import show_progress

    screen = io.StringIO()
    with show_progress(Console(file=screen, width=120)):
        results = run_checks(ops=["cast", "int8_vectorwise_quant"])
    shown = screen.getvalue()
    for op in ("cast", "int8_vectorwise_quant"):
        checks = sum(r.op == op for r in results)
        assert checks and f"{checks}/{checks}" in shown and op in shown
