"""The loaders under generated hostile folders (D7, D9): safetensors headers, shard
indexes, config.json, tightfit-plan.json and bitsandbytes quantization configs. Every
case ends in what the reference reads or computes, or in a clean error. Cases run in
worker processes, so a crash or a hang fails the test with the case that caused it (the
harness is tightfit.loading.fuzz; `make fuzz` runs a longer campaign)."""

from __future__ import annotations

import json
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit._fuzz_campaign import run_campaign
from tightfit.loading import fuzz

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def test_generated_folders_end_in_the_reference_or_a_clean_error():
    result = run_campaign("tightfit.loading.fuzz", 150, seed=5)
    assert result.findings == []
    assert sum(result.counts.values()) == 150
    # both kinds are exercised: folders that must load as the reference, hostile ones that must be refused
    assert result.counts["equal"] > 20 and result.counts["clean"] > 40


def test_every_target_is_fuzzed_and_cases_are_reproducible():
    cases = [fuzz.make_case(3, index) for index in range(20)]
    assert {case.op for case in cases} == set(fuzz.TARGETS)
    again = fuzz.make_case(3, 17)
    assert (again.op, again.label, again.call) == (cases[17].op, cases[17].label, cases[17].call)


@pytest.mark.parametrize(
    "target, mutations",
    [
        ("config", [("set", "architectures", "LlamaForCausalLM")]),  # one name, read as transformers reads it
        ("config", [("set", "tie_word_embeddings", True)]),  # tied, but the checkpoint's two differ: refused
        ("config", [("set", "hidden_act", "nonesuch")]),
        ("config", [("set", "num_hidden_layers", 2**64)]),  # built layer after layer, forever
        ("index", [("shard", "directory"), ("shard", "garbage")]),
        ("index", [("entry", 0, "model-00001-of-00002.safetensors\u0000")]),
        ("plan", [("entries", "duplicate", 1)]),
        ("plan", [("entry", 2, "module", "nonesuch")]),
        ("bitsandbytes", [("set", "quantization_config", [1])]),
        ("bitsandbytes", [("field", "unknown_key", 1)]),
    ],
)
def test_cases_the_campaign_found(target, mutations):
    outcome, detail = fuzz.run_folder(target, mutations)
    assert outcome in ("equal", "clean"), detail


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_any_generated_header_reads_as_the_safetensors_library_or_is_refused(seed):
    case = fuzz.draw_header(random.Random(seed))
    outcome, detail = fuzz.run_header(case)
    assert outcome in ("equal", "clean"), detail
    if fuzz._valid_header(case):
        assert outcome == "equal", detail


@settings(max_examples=80, deadline=None)
@given(
    data=st.binary(max_size=300),
    claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_any_bytes_are_read_as_the_library_reads_them_or_refused(tmp_path_factory, data, claimed):
    """Arbitrary bytes behind a header length that is right, or anything: never an unclean error."""
    from safetensors import safe_open

    from tightfit.loading import Checkpoint

    folder = tmp_path_factory.mktemp("bytes")
    length = len(data) if claimed is None else claimed
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", length) + data)
    try:
        checkpoint = Checkpoint(folder)
        read = {name: fuzz._as_bytes(checkpoint.read(name)) for name in checkpoint.entries}
    except ValueError:
        return
    with safe_open(str(folder / "model.safetensors"), "pt") as reference:
        assert read == {name: fuzz._as_bytes(reference.get_tensor(name)) for name in reference.keys()}  # noqa: SIM118


def test_the_json_writer_of_the_cases_repeats_keys_and_keeps_raw_text():
    text = fuzz.dumps(fuzz.Pairs([("a", 1), ("a", fuzz.Raw("NaN"))]))
    assert text == '{"a":1,"a":NaN}'
    assert json.loads(fuzz.dumps({"b": [fuzz.Raw("[1]")]})) == {"b": [[1]]}
