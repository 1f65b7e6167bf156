"""A generation's last decode step traced beside the prefill (``fit(..., decode=DecodeTrace)``):
its peak, the KV cache at its longest, is a phase of the plan; the plan holds the larger
of the two and says both; bad descriptions of the step are refused naming what is wrong."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit
from tightfit.app.kv_cache import cache_argument
from tightfit.fitting import FitPlan
from tightfit.fitting.traced import DECODE, DecodeTrace
from zoo.lm import figures

transformers = pytest.importorskip("transformers")

PROMPT = torch.arange(3, 11).unsqueeze(0)  # 8 tokens
CONFIG = dict(
    vocab_size=8000,  # embeddings of 1 MB each: weights that moving off the device saves
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
PER_TOKEN = 2 * 2 * 2 * 8 * 4  # K and V x layers x KV heads x head size x float32


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def last_step(model: torch.nn.Module, context: int) -> DecodeTrace:
    """The decode step after ``context - 1`` positions, as tightfit run's generation makes it."""

    def script(calls) -> None:
        cache = cache_argument(model)  # the keyword this transformers takes it by
        ids = torch.zeros(1, context - 1, dtype=torch.long, device=calls.device)
        token = calls.call(input_ids=ids, use_cache=True, **cache).logits[:, -1:].argmax(-1)
        calls.phase(DECODE)
        calls.call(input_ids=token, use_cache=True, **cache)

    return DecodeTrace(script, context, "model", context * PER_TOKEN)


def plan(model: torch.nn.Module, budget: int, decode: DecodeTrace | None = None, **extra) -> FitPlan:
    return tightfit.fit(model, PROMPT, budget, calibration=figures(), decode_steps=4, decode=decode, **extra)


def test_the_plan_s_peak_is_the_larger_phase_and_says_both():
    model = llama()
    short, long = plan(model, 1 << 30, last_step(model, 12)), plan(model, 1 << 30, last_step(model, 4000))
    for made in (short, long):
        assert made.predicted_peak_bytes == max(made.phase_peaks.values())
        assert made.full_peak_bytes == made.predicted_peak_bytes  # the budget covers the unchanged model
    assert short.phase_peaks["prefill"] >= short.phase_peaks[DECODE]  # 12 positions: the prefill's activations
    assert long.phase_peaks[DECODE] > long.phase_peaks["prefill"] == short.phase_peaks["prefill"]
    weights = sum(p.nbytes for p in model.parameters())
    assert long.phase_peaks[DECODE] >= weights + 4000 * PER_TOKEN  # the whole cache, held beside the weights
    assert long.kv_cache == {"format": "model", "context": 4000, "bytes": 4000 * PER_TOKEN}
    assert "last decode step" in str(long) and "KV cache (model) at 4,000 positions" in str(long)
    assert FitPlan.from_json(long.to_json()) == long
    assert plan(model, 1 << 30).phase_peaks == {} and plan(model, 1 << 30).kv_cache == {}


def test_a_budget_the_prefill_meets_but_the_long_decode_does_not_moves_more_off_the_device():
    model = llama()
    long = plan(model, 1 << 30, last_step(model, 4000))
    budget = (long.phase_peaks["prefill"] + long.phase_peaks[DECODE]) // 2
    unaware = plan(model, budget)  # the prefill alone: the budget covers the unchanged model
    aware = plan(model, budget, last_step(model, 4000))
    assert unaware.applies_nothing and not aware.applies_nothing
    assert aware.predicted_peak_bytes <= budget and aware.predicted_weights_bytes < unaware.predicted_weights_bytes


def test_decode_needs_decode_steps_and_a_decode_trace():
    model = llama()
    with pytest.raises(ValueError, match="decode .* needs decode_steps >= 1"):
        tightfit.fit(model, PROMPT, 1 << 30, calibration=figures(), decode=last_step(model, 12))
    with pytest.raises(TypeError, match="decode must be"):
        plan(model, 1 << 30, decode={"context": 12})


def test_a_script_that_never_names_the_decode_phase_is_refused():
    def script(calls) -> None:
        calls.call(input_ids=torch.zeros(1, 4, dtype=torch.long, device=calls.device))

    with pytest.raises(ValueError, match="ran no op after calls.phase"):
        plan(llama(), 1 << 30, DecodeTrace(script, 5, "model", 0))


@settings(max_examples=40, deadline=None)
@given(
    context=st.one_of(st.integers(-3, 0), st.floats(allow_nan=True), st.none(), st.text(max_size=3), st.booleans()),
    kv_format=st.one_of(st.just(""), st.integers(), st.none()),
    kv_bytes=st.one_of(st.integers(max_value=-1), st.floats(), st.none(), st.booleans()),
    which=st.sampled_from(["script", "context", "kv_format", "kv_cache_bytes"]),
)
def test_a_bad_decode_trace_is_refused_naming_the_field(context, kv_format, kv_bytes, which):
    good = dict(script=lambda calls: None, context=5, kv_format="model", kv_cache_bytes=10)
    bad = {"script": "not callable", "context": context, "kv_format": kv_format, "kv_cache_bytes": kv_bytes}
    with pytest.raises((TypeError, ValueError), match=f"DecodeTrace.{which}"):
        DecodeTrace(**{**good, which: bad[which]})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("phase_peaks", {"prefill": 10}, "must name the phases prefill, decode or none"),
        ("phase_peaks", {"prefill": 10, "decode": -1}, "phase_peaks"),
        ("phase_peaks", [1, 2], "phase_peaks must be a dict"),
        ("kv_cache", {"format": "model"}, "must have the keys format, context, bytes"),
        ("kv_cache", {"format": "model", "context": -2, "bytes": 0}, r"kv_cache\['context'\] must be an int >= 0"),
        ("kv_cache", {"format": 3, "context": 2, "bytes": 0}, r"kv_cache\['format'\] must be a str"),
        ("kv_cache", {"format": "model", "context": 2, "bytes": math.inf}, r"kv_cache\['bytes'\]"),
    ],
)
def test_a_plan_with_bad_phases_or_cache_is_refused(field, value, message):
    model = llama()
    made = plan(model, 1 << 30, last_step(model, 12))
    data = made.to_dict() | {field: value}
    data.pop("format")
    data["entries"] = made.entries
    with pytest.raises((TypeError, ValueError), match=message):
        FitPlan(**data)
