"""The KV cache and the context as terms of a causal LM's plan (``--context N|auto``): the
cache's bytes predicted to the byte, held in the plan's traced decode step, and the longest context the
budget allows chosen with what limited it; a run at that context stays within the budget."""

from __future__ import annotations

import pytest
import torch

from tightfit.app.kv_cache import bytes_per_token, cache_argument
from tightfit.app.models import load_causal_lm, load_tokenizer
from tightfit.app.run import DEFAULT_PROMPT, RunOptions, plan_only, run
from tightfit.fitting import FitError

pytest.importorskip("transformers")

MAX_POSITIONS = 64  # the tiny model's max_position_embeddings


def _prompt_tokens(folder) -> int:
    return load_tokenizer(folder)(DEFAULT_PROMPT, return_tensors="pt").input_ids.shape[1]


@pytest.mark.parametrize("kv_format", ["model", "float8"])
def test_the_cache_holds_to_the_byte_what_is_predicted(tiny_llama, kv_format):
    model, _ = load_causal_lm(tiny_llama, torch.device("cpu"))
    per_token = bytes_per_token(model.config, torch.float32, kv_format)
    cache = cache_argument(model, kv_format)  # the cache as tightfit run's generation makes it
    ids = torch.randint(1, model.config.vocab_size, (1, 11))
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **cache)
        for _ in range(6):
            model(input_ids=ids[:, :1], use_cache=True, **cache)
    (held_cache,) = cache.values()
    names = ("keys", "values", "key_scales", "value_scales")
    held = sum(getattr(layer, name).nbytes for layer in held_cache.layers for name in names if hasattr(layer, name))
    assert held == per_token * 17


def test_context_n_is_the_context_of_the_plan_s_last_decode_step(tiny_llama):
    budgeted = plan_only(RunOptions(model=str(tiny_llama), budget="8MB", max_new_tokens=2, context=40))
    per_token = bytes_per_token(load_causal_lm(tiny_llama, torch.device("cpu"))[0].config, torch.float32)
    plan = budgeted.plan
    assert budgeted.context == 40 and plan.kv_cache == {"format": "model", "context": 40, "bytes": 40 * per_token}
    assert "its KV cache at a context of 40 positions" in budgeted.covers
    assert plan.phase_peaks["decode"] >= plan.predicted_weights_bytes + 40 * per_token  # the whole cache, held
    assert "last decode step" in str(plan) and "KV cache (model) at 40 positions" in str(plan)


def test_context_auto_takes_the_model_s_maximum_where_the_budget_has_room(tiny_llama):
    budgeted = plan_only(RunOptions(model=str(tiny_llama), budget="8MB", max_new_tokens=2, context="auto"))
    assert budgeted.context == MAX_POSITIONS and "the model's max_position_embeddings" in budgeted.covers


def test_context_auto_limited_by_the_budget_and_a_run_at_that_context_stays_within_it(tiny_llama):
    prompt = _prompt_tokens(tiny_llama)
    with pytest.raises(FitError) as caught:  # the smallest plan at a context of 40, which a budget of it fits exactly
        plan_only(RunOptions(model=str(tiny_llama), budget=20_000, max_new_tokens=2, context=40))
    budget = caught.value.smallest_peak_bytes
    options = {"model": str(tiny_llama), "budget": budget, "max_new_tokens": 2, "kv_cache": "model"}
    budgeted = plan_only(RunOptions(context="auto", **options))
    assert budgeted.context == 40 and "the longest the budget leaves room for" in budgeted.covers
    assert budgeted.predicted_peak_bytes <= budget
    with pytest.raises(FitError):  # one position more does not fit: 40 is the longest
        plan_only(RunOptions(context=41, **options))
    report = run(
        RunOptions(
            model=str(tiny_llama),
            budget=budget,
            context=40,
            max_new_tokens=40 - prompt + 1,  # the run's cache reaches the whole context
            repeat=1,
            reference=False,
        )
    )
    assert report.measurement.peak_bytes <= report.predicted_peak_bytes <= budget


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(context=5, budget="8MB"), r"context=5 is outside what this run can use: at least the \d+ positions"),
        (dict(context=65, budget="8MB"), r"at most the model's 64 \(max_position_embeddings\)"),
        (dict(context=40), r"context=40 plans the KV cache within a budget; give budget too"),
        (dict(context="long", budget="8MB"), r"context must be an int >= 1 \(positions\) or 'auto', got 'long'"),
        (dict(context=0, budget="8MB"), r"context must be an int >= 1"),
    ],
)
def test_bad_contexts_are_refused(tiny_llama, options, message):
    with pytest.raises(ValueError, match=message):
        plan_only(RunOptions(model=str(tiny_llama), max_new_tokens=2, **options))


def test_an_encoder_takes_no_context():
    with pytest.raises(
        ValueError, match=r"context applies to causal LMs; the built-in model is an encoder, which embeds sentences"
    ):
        plan_only(RunOptions(budget="80MB", context=64))


@pytest.mark.parametrize("kv_format", ["model", "float8"])
def test_the_last_decode_step_is_traced_and_its_peak_predicted_to_the_byte(tiny_llama, kv_format):
    # the run reaches the model's whole context: its last decode step, the cache at its longest,
    # holds more than the prefill of the short prompt, and the plan's peak is that step's
    prompt = load_tokenizer(tiny_llama)("Once", return_tensors="pt").input_ids.shape[1]
    options = {"model": str(tiny_llama), "budget": "8MB", "kv_cache": kv_format, "repeat": 1, "reference": False}
    report = run(RunOptions(prompt="Once", max_new_tokens=MAX_POSITIONS - prompt, **options))
    plan = report.budgeted.plan
    assert plan.kv_cache["context"] == MAX_POSITIONS - 1 and plan.kv_cache["format"] == kv_format
    assert plan.phase_peaks["decode"] > plan.phase_peaks["prefill"]
    assert plan.predicted_peak_bytes == plan.phase_peaks["decode"]
    assert report.predicted_peak_bytes == report.measurement.peak_bytes
