"""The raw ops under generated hostile arguments (D9): every case ends in the reference's
result or a clean error. Cases run in worker processes, so a crash or a hang fails the
test with the case that caused it instead of killing the run (the harness is
tightfit.ops.fuzz; `make fuzz` runs a longer campaign)."""

from __future__ import annotations

import pytest

from tightfit._fuzz_campaign import run_campaign
from tightfit.ops import registered_ops
from tightfit.ops.fuzz import make_case, run_case


def test_generated_cases_end_in_the_reference_or_a_clean_error():
    result = run_campaign("tightfit.ops.fuzz", 300, seed=12)
    assert result.findings == []
    assert sum(result.counts.values()) == 300
    # both kinds are exercised: valid calls that must match, hostile calls that must be refused
    assert result.counts["equal"] > 80 and result.counts["clean"] > 80


def test_every_op_is_fuzzed():
    fuzzed = {make_case(1, index).op for index in range(400)}
    assert fuzzed == {name for name in registered_ops() if not name.startswith("test_")}  # tests define test_* ops


def test_int8_linear_cases_end_in_the_reference_or_a_clean_error():
    cases = [(index, make_case(7, index)) for index in range(800)]
    outcomes = [run_case(case, index)[0] for index, case in cases if case.op == "int8_linear"][:40]
    assert len(outcomes) == 40 and set(outcomes) == {"equal", "clean"}


@pytest.mark.parametrize("op", ["gemv_float8", "gemv_blockwise", "gemv_4bit_int8", "gemv_blockwise_int8"])
def test_native_gemv_cases_end_in_the_reference_or_a_clean_error(op):
    """The ops whose CPU kernels are native C, in this process: hostile arguments must be
    refused before the kernel, valid ones must agree with the reference."""
    cases = [(index, make_case(9, index)) for index in range(1000)]
    outcomes = [run_case(case, index)[0] for index, case in cases if case.op == op][:40]
    assert len(outcomes) == 40 and set(outcomes) == {"equal", "clean"}


def test_cases_are_reproducible_from_seed_and_index():
    first, again = make_case(3, 17), make_case(3, 17)
    assert (first.op, first.label, first.valid) == (again.op, again.label, again.valid)


def test_a_crashing_and_a_hanging_case_are_recorded_and_the_campaign_goes_on(monkeypatch):
    monkeypatch.setenv("TIGHTFIT_FUZZ_SELFTEST", "crash:1,hang:3")  # the worker kills itself at case 1, stalls at 3
    # case_timeout governs cases 1 and 3 only (a worker's first case has its own): the crash
    # ends at once and the hang waits it out, so 3 s is ample
    result = run_campaign("tightfit.ops.fuzz", 5, seed=0, case_timeout=3.0)
    assert result.counts["crash"] == 1 and result.counts["hang"] == 1 and sum(result.counts.values()) == 5
    assert [finding.split(" ")[:3] for finding in result.findings] == [["case", "1:", "crash"], ["case", "3:", "hang"]]


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        run_campaign("tightfit.ops.fuzz", 0)
    with pytest.raises(ValueError, match="target must name an importable module"):
        run_campaign("tightfit.no_such_module", 5)
