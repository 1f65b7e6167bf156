"""Loading quantized checkpoints: every entry is checked when read, a layer loads all
of its entries or none, and corrupted checkpoints (fuzzed, in a worker process so a
crash fails a test instead of ending the run) end equal to the reference or in a clean
error (ValueError / TypeError, or torch's report of missing keys)."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tightfit.quant.fuzz as quant_fuzz
from tightfit._fuzz_campaign import run_campaign
from tightfit.quant import Linear4bit, LinearInt8, QuantState
from tightfit.quant.fuzz import same, snapshot


def layer(kind: str, seed: int = 0) -> nn.Module:
    return quant_fuzz.KINDS[kind](quant_fuzz.linear(seed))


def with_metadata(state_dict: dict, **changes) -> dict:
    """``state_dict`` with fields of its packed JSON changed."""
    key = next(key for key in state_dict if quant_fuzz.is_packed(key))
    metadata = json.loads(bytes(state_dict[key].tolist()))
    metadata.update(changes)
    return {**state_dict, key: torch.tensor(list(json.dumps(metadata).encode()), dtype=torch.uint8)}


# -- regression tests for issue 12, item 3 -----------------------------------------------------


@pytest.mark.parametrize("kind", sorted(quant_fuzz.KINDS))
def test_a_checkpoint_without_its_scales_fails_strict_loading_and_changes_nothing(kind):
    state_dict = layer(kind).state_dict()
    kept = {key: value for key, value in state_dict.items() if key in ("weight", "bias")}
    target = layer(kind, seed=1)
    before = snapshot(target)
    with pytest.raises(RuntimeError, match="Missing key") as error:
        target.load_state_dict(kept)
    absent = sorted(set(state_dict) - set(kept) - {"weight_format"})  # optional: bitsandbytes' readers default it
    assert all(f'"{key}"' in str(error.value) for key in absent)
    result = target.load_state_dict(kept, strict=False)
    assert sorted(result.missing_keys) == absent
    assert same(snapshot(target), before)  # never the new weight with the old scales


def test_a_checkpoint_without_its_weight_or_bias_loads_nothing():
    state_dict = layer("nf4").state_dict()
    target = layer("nf4", seed=1)
    before = snapshot(target)
    for absent in ("weight", "bias"):
        result = target.load_state_dict({k: v for k, v in state_dict.items() if k != absent}, strict=False)
        assert result.missing_keys == [absent] and same(snapshot(target), before)


def nan_at_0(tensor):
    tensor = tensor.clone()
    tensor[0] = float("nan")
    return tensor


@pytest.mark.parametrize(
    ("kind", "key", "damage", "error", "match"),
    [
        ("nf4", "weight.absmax", nan_at_0, ValueError, r"weight.absmax\[0\] is nan; accepted: finite scales >= 0"),
        ("nf4", "weight.absmax", lambda t: t + float("inf"), ValueError, r"weight.absmax\[0\] is inf"),
        (
            "8bit",
            "weight.absmax",
            lambda t: -t,
            ValueError,
            r"weight.absmax\[0\] is -[0-9.]+; accepted: finite scales >= 0",
        ),
        (
            "nf4",
            "weight.absmax",
            lambda t: t.to(torch.int32),
            TypeError,
            "weight.absmax has dtype torch.int32; accepted: torch.float32",
        ),
        ("8bit", "weight.absmax", lambda t: t.bool(), TypeError, "weight.absmax has dtype torch.bool"),
        ("nf4", "weight.absmax", lambda t: t.half(), TypeError, "weight.absmax has dtype torch.float16"),
        ("nf4", "weight.absmax", lambda t: t[:-1], ValueError, r"weight.absmax has shape \(4,\); accepted: \(5,\)"),
        (
            "8bit",
            "weight.absmax",
            lambda t: t[:-1],
            ValueError,
            r"weight.absmax has 4 values; \(7, 37\) in blocks of 64 needs 5",
        ),
        ("fp4-nested", "weight.nested_absmax", nan_at_0, ValueError, r"weight.nested_absmax\[0\] is nan"),
        (
            "8bit-nested",
            "weight.absmax",
            lambda t: t.float(),
            TypeError,
            "weight.absmax has dtype torch.float32; accepted: torch.uint8",
        ),
        ("int8", "SCB", nan_at_0, ValueError, r"SCB\[0\] is nan"),
        ("int8", "SCB", lambda t: -t, ValueError, r"SCB\[0\] is -"),
        ("int8", "SCB", lambda t: t.double(), TypeError, "SCB has dtype torch.float64"),
        ("int8", "weight", lambda t: t.float(), TypeError, "weight has dtype torch.float32; accepted: torch.int8"),
        ("int8", "weight", lambda t: t.t(), ValueError, r"weight has shape \(37, 7\); accepted: \(7, 37\)"),
        ("8bit", "weight", lambda t: t.to(torch.int8), TypeError, "weight has dtype torch.int8; accepted: torch.uint8"),
        ("nf4", "weight", lambda t: t.bool(), ValueError, "weight.dtype=torch.bool is not accepted"),
        (
            "nf4",
            "weight",
            lambda t: t[:-1],
            ValueError,
            "weight holds 129 packed bytes but shape \\(7, 37\\) needs 130",
        ),
        ("nf4", "weight.quant_map", lambda t: t * 2, ValueError, "weight.quant_map .* is not the nf4 table"),
        (
            "8bit",
            "weight.quant_map",
            lambda t: t.flip(0),
            ValueError,
            "weight.quant_map has NaN, inf or unsorted values",
        ),
        ("nf4", "bias", lambda t: t[:-1], ValueError, r"bias has shape \(6,\); accepted: \(7,\)"),
        ("nf4", "bias", lambda t: t.long(), TypeError, "bias has dtype torch.int64; accepted: a floating-point dtype"),
    ],
)
def test_bad_entries_are_refused_and_the_layer_is_unchanged(kind, key, damage, error, match):
    state_dict = layer(kind).state_dict()
    state_dict[key] = damage(state_dict[key])
    target = layer(kind, seed=1)
    before = snapshot(target)
    with pytest.raises(error, match=match):
        target.load_state_dict(state_dict)
    assert same(snapshot(target), before)


@pytest.mark.parametrize(
    ("kind", "changes", "error", "match"),
    [
        (
            "fp4-nested",
            {"nested_offset": float("nan")},
            ValueError,
            r"\['nested_offset'\]=nan is not accepted; accepted: a finite float32 number >= 0",
        ),
        ("fp4-nested", {"nested_offset": float("inf")}, ValueError, r"\['nested_offset'\]=inf is not accepted"),
        ("8bit-nested", {"nested_offset": "nan"}, TypeError, r"\['nested_offset'\] must be a number, got str"),
        ("8bit-nested", {"nested_offset": -0.5}, ValueError, r"\['nested_offset'\]=-0.5"),
        ("8bit-nested", {"nested_offset": 10**400}, ValueError, r"\['nested_offset'\]=1000"),
        ("nf4", {"blocksize": 63}, ValueError, r"\['blocksize'\]=63 is not accepted; accepted: 1024, 128"),
        ("nf4", {"blocksize": 64.0}, TypeError, r"\['blocksize'\] must be int, got float"),
        ("nf4", {"blocksize": 128}, ValueError, r"weight.absmax has shape \(5,\); accepted: \(3,\)"),
        (
            "nf4",
            {"dtype": "float64"},
            ValueError,
            r"\['dtype'\]='float64' is not accepted; accepted: bfloat16, float16, float32",
        ),
        (
            "nf4",
            {"shape": [37, 7]},
            ValueError,
            r"weight's quant state is nf4 of shape torch.Size\(\[37, 7\]\); accepted: nf4 or fp4 of shape \(7, 37\)",
        ),
        ("nf4", {"shape": [7, "37"]}, TypeError, r"\['shape'\] must be a list of ints"),
        ("nf4", {"shape": None}, ValueError, "a 4-bit state needs the shape"),
        (
            "nf4",
            {"quant_type": "fp4"},
            ValueError,
            "is quant_type='fp4' but the packed entry is 'weight.quant_state.bitsandbytes__nf4'",
        ),
        ("8bit", {"quant_type": "nf4"}, ValueError, "is quant_type='nf4' but the packed entry"),
        ("8bit", {"shape": [7, 37, 1]}, ValueError, "accepted: 8-bit blockwise of shape"),
        ("nf4", {"checksum": 1}, ValueError, r"\['checksum'\] is not a quant state entry"),
    ],
)
def test_bad_metadata_is_refused(kind, changes, error, match):
    target = layer(kind, seed=1)
    before = snapshot(target)
    with pytest.raises(error, match=match):
        target.load_state_dict(with_metadata(layer(kind).state_dict(), **changes))
    assert same(snapshot(target), before)


def blob(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


NF4_ITEMS = quant_fuzz.state_items("nf4", packed=True)
KEY = "quant_state.bitsandbytes__nf4"


@pytest.mark.parametrize(
    ("items", "error", "match"),
    [
        ({**NF4_ITEMS, KEY: blob(b"[" * 60000)}, ValueError, "does not hold valid UTF-8 JSON: nested too deeply"),
        (
            {**NF4_ITEMS, KEY: blob(b"[" * 70000)},
            ValueError,
            r"has shape \(70000,\); accepted: 1-D, at most 65536 bytes",
        ),
        (
            {**NF4_ITEMS, KEY: blob(b'{"blocksize": ' + b"9" * 5000 + b"}")},
            ValueError,
            "does not hold valid UTF-8 JSON: Exceeds the limit",
        ),
        ({**NF4_ITEMS, KEY: blob(b"\xff{}")}, ValueError, "does not hold valid UTF-8 JSON: 'utf-8' codec"),
        ({**NF4_ITEMS, KEY: blob(b"[1, 2]")}, ValueError, "holds JSON list; accepted: a JSON object"),
        ({**NF4_ITEMS, KEY: blob(b"{}")}, ValueError, r"quant state is missing \['blocksize', 'dtype'\]"),
        ({**NF4_ITEMS, KEY: blob(b"{}").reshape(1, -1)}, ValueError, r"has shape \(1, 2\); accepted: 1-D"),
        ({**NF4_ITEMS, KEY: blob(b"{}").to(torch.int8)}, TypeError, "has dtype torch.int8; accepted: torch.uint8"),
        ({**NF4_ITEMS, KEY: '{"blocksize": 64}'}, TypeError, "quant_state.bitsandbytes__nf4 must be Tensor, got str"),
        (
            {**NF4_ITEMS, "quant_state.bitsandbytes__int4": NF4_ITEMS[KEY]},
            ValueError,
            "packed entry name.*'bitsandbytes__int4' is not accepted",
        ),
        (
            {**NF4_ITEMS, "quant_state.bitsandbytes__fp4": NF4_ITEMS[KEY]},
            ValueError,
            "at most one packed quant_state entry",
        ),
        ({**NF4_ITEMS, "x.absmax": NF4_ITEMS["absmax"]}, ValueError, "x.absmax is given twice"),
        ({**NF4_ITEMS, "nested_absmax": torch.ones(1)}, ValueError, "double-quantization entries come together"),
        ({**NF4_ITEMS, "absmax": torch.ones(5).to_sparse()}, ValueError, "absmax must be a dense tensor holding data"),
        (
            {**NF4_ITEMS, "absmax": torch.ones(5, device="meta")},
            ValueError,
            "absmax must be a dense tensor holding data",
        ),
        ({**NF4_ITEMS, 3: torch.ones(1)}, TypeError, "quant state key must be str, got int"),
        ({k: v for k, v in NF4_ITEMS.items() if k != "absmax"}, ValueError, r"quant state is missing \['absmax'\]"),
        (
            {**quant_fuzz.state_items("nf4", packed=False), "blocksize": True},
            TypeError,
            "blocksize must be int, got bool",
        ),
        (
            {
                **quant_fuzz.state_items("8bit", packed=False),
                "quant_map": quant_fuzz.state_items("nf4", packed=False)["quant_map"],
            },
            ValueError,
            r"quant_map has shape \(16,\); accepted: \(256,\)",
        ),
        (
            {**quant_fuzz.state_items("8bit-nested", packed=False), "nested_offset": None},
            TypeError,
            "nested_offset must be a number, got NoneType",
        ),
    ],
)
def test_from_dict_refuses_damaged_entries_cleanly(items, error, match):
    with pytest.raises(error, match=match):
        QuantState.from_dict(items)


def test_from_dict_reads_what_bitsandbytes_reads_and_leaves_the_input_alone():
    items = quant_fuzz.state_items("fp4-nested", packed=True)
    copy = dict(items)
    state = QuantState.from_dict(items)
    assert (
        list(items) == list(copy)
        and all(items[key] is copy[key] for key in copy)
        and state.nested
        and state.shape == (7, 37)
        and state.state2.blocksize == 256
    )
    with pytest.raises(ValueError, match="device='tpu' is not a valid torch device"):
        QuantState.from_dict(items, device="tpu")


def test_a_layer_takes_another_4bit_format_but_not_another_kind():
    source = Linear4bit.from_linear(
        quant_fuzz.linear(0), quant_type="fp4", blocksize=128, compress_statistics=True, quant_storage=torch.bfloat16
    )
    target = layer("nf4", seed=1)  # nf4, blocks of 64, uint8 storage
    target.load_state_dict(source.state_dict())
    assert target.quant_state.quant_type == "fp4" and target.weight.dtype == torch.bfloat16
    assert torch.equal(target.dequantize(), source.dequantize())
    eight = layer("8bit", seed=1)
    with pytest.raises(ValueError, match="weight's quant state is fp4 .* accepted: 8-bit blockwise"):
        eight.load_state_dict(source.state_dict())


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_loading_copies_the_bias_into_its_dtype_and_assign_takes_the_checkpoint_tensors(kind):
    source = layer(kind).state_dict()
    target = quant_fuzz.KINDS[kind](quant_fuzz.linear(1).to(torch.bfloat16))
    target.load_state_dict(source)
    assert target.bias.dtype == torch.bfloat16 and torch.equal(target.bias, source["bias"].to(torch.bfloat16))
    target.load_state_dict(source, assign=True)
    assert target.weight is source["weight"] and target.bias.dtype == torch.float32 and not target.bias.requires_grad


def test_int8_checkpoints_move_between_bitsandbytes_and_tightfit():
    bnb = pytest.importorskip("bitsandbytes")
    linear = quant_fuzz.linear(0)
    theirs = bnb.nn.Linear8bitLt(37, 7, has_fp16_weights=False)
    theirs.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    theirs.bias = nn.Parameter(linear.bias.data.clone())
    theirs = theirs.to("cpu")  # quantizes
    ours = layer("int8", seed=1)
    ours.load_state_dict(theirs.state_dict())  # weight, bias, SCB and weight_format 0
    assert torch.equal(ours.weight, theirs.weight.data) and torch.equal(ours.SCB, theirs.weight.SCB)
    reference = LinearInt8.from_linear(linear)
    back = bnb.nn.Linear8bitLt(37, 7, has_fp16_weights=False)
    back.weight = bnb.nn.Int8Params(
        quant_fuzz.linear(1).weight.data.clone(), requires_grad=False, has_fp16_weights=False
    )
    back = back.to("cpu")
    back.load_state_dict(reference.state_dict(), strict=False)
    assert torch.equal(back.weight.data, reference.weight) and torch.equal(back.weight.SCB, reference.SCB)
    with pytest.raises(ValueError, match="weight_format must be one number, 0"):
        layer("int8", seed=1).load_state_dict(
            {**theirs.state_dict(), "weight_format": torch.tensor(1, dtype=torch.uint8)}
        )


# -- issue 12, item 5: inputs nn.Linear refuses ------------------------------------------------


@pytest.mark.parametrize("kind", ["nf4", "8bit", "int8"])
@pytest.mark.parametrize(
    "dtype",
    [torch.int64, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float64, torch.complex64],
    ids=str,
)
def test_non_float_inputs_are_refused(kind, dtype):
    with pytest.raises(TypeError, match=f"x has dtype {dtype}; accepted: float32, float16, bfloat16"):
        layer(kind)(torch.ones(2, 37).to(dtype))


# -- fuzzing ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker():
    """One process that runs the cases: a crash in it breaks the pool and fails the test."""
    with ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=torch.set_num_threads, initargs=(1,)
    ) as pool:
        yield pool


def in_worker(worker: ProcessPoolExecutor, function, *args):
    try:
        return worker.submit(function, *args).result(timeout=300)
    except BrokenProcessPool:
        pytest.fail(f"the worker process died running {function.__name__}{args!r:.2000}")


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(sorted(quant_fuzz.KINDS)), rng=st.randoms(use_true_random=False), strict=st.booleans())
def test_fuzzed_state_dicts_load_equal_to_the_reference_or_fail_cleanly(worker, kind, rng, strict):
    mutations = quant_fuzz.draw_mutations(rng, quant_fuzz.reference(kind)[1])
    outcome = in_worker(worker, quant_fuzz.run_load, kind, mutations, strict)
    assert not outcome.startswith("FAIL"), quant_fuzz.describe((kind, strict, mutations)) + outcome


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(quant_fuzz.STATE_KINDS), rng=st.randoms(use_true_random=False), packed=st.booleans())
def test_fuzzed_quant_states_decode_equal_to_the_reference_or_fail_cleanly(worker, kind, rng, packed):
    mutations = quant_fuzz.draw_mutations(rng, quant_fuzz.state_items(kind, packed))
    outcome = in_worker(worker, quant_fuzz.run_from_dict, kind, packed, mutations)
    assert not outcome.startswith("FAIL"), quant_fuzz.describe((kind, packed, mutations)) + outcome


def test_a_seeded_campaign_of_corrupted_checkpoints():
    result = run_campaign("tightfit.quant.fuzz", 800, seed=12)  # worker processes: a crash is blamed on its case
    assert not result.findings, "\n".join(result.findings[:5])
    # both ways out are reached: loaded as the reference, refused or reported cleanly
    assert sum(result.counts.values()) == 800 and min(result.counts["equal"], result.counts["clean"]) > 0, result.counts
