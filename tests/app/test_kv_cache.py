"""The KV cache's format as a choice of the run (``--kv-cache model|float8|auto``): float8
keeps what the model computes close, its decoded layer is in the traced decode step, ``auto`` takes float8
only where the budget needs it and says so, and a run at the context chosen stays within
the budget."""

from __future__ import annotations

import json

import pytest
import torch

from tightfit.app.cli import main
from tightfit.app.generation import generate_greedy
from tightfit.app.kv_cache import bytes_per_token, cache_argument, decoded_bytes
from tightfit.app.models import load_causal_lm, save_causal_lm
from tightfit.app.run import RunOptions, plan_only, run

transformers = pytest.importorskip("transformers")


def test_float8_keeps_the_model_s_next_token_logits_close(tiny_llama):
    model, _ = load_causal_lm(tiny_llama, torch.device("cpu"))
    torch.manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (1, 24))
    logits = {}
    for kv_format in ("model", "float8"):
        cache = cache_argument(model, kv_format)
        with torch.inference_mode():
            model(input_ids=ids[:, :-4], use_cache=True, **cache)
            for position in range(-4, 0):
                out = model(input_ids=ids[:, position:][:, :1], use_cache=True, **cache).logits
        logits[kv_format] = out[0, -1]
    error = (logits["float8"] - logits["model"]).norm() / logits["model"].norm()
    assert 0 < error < 0.05  # float8 (3 mantissa bits) per position and head: a few percent at most


def test_float8_bytes_per_token_and_decoded_layer():
    config = transformers.LlamaConfig(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=256
    )  # head_dim 32
    assert bytes_per_token(config, torch.bfloat16, "model") == 2 * 4 * 2 * 32 * 2
    assert bytes_per_token(config, torch.bfloat16, "float8") == 2 * 4 * 2 * (32 + 4)
    assert decoded_bytes(config, torch.bfloat16, "float8", 100) == 2 * 2 * 32 * 100 * 2
    assert decoded_bytes(config, torch.bfloat16, "model", 100) == 0


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    """A causal LM whose KV cache at its 64 positions (2 KiB a position in float32) outweighs
    its layers; its embeddings go to disk under ``--allow keep,disk``."""
    return save_causal_lm(
        tmp_path_factory.mktemp("long-context"),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def test_auto_takes_float8_only_where_the_budget_needs_it_and_a_run_at_its_context_stays_within(long_context_llama):
    options = {"model": str(long_context_llama), "max_new_tokens": 2, "context": "auto", "allow": "keep,disk"}
    roomy = plan_only(RunOptions(budget="4MB", **options))
    assert roomy.kv_format == "model" and roomy.context == 64 and roomy.plan.kv_cache["format"] == "model"
    tight = plan_only(RunOptions(budget=230_000, **options))
    kept = plan_only(RunOptions(budget=230_000, kv_cache="model", **options))
    assert kept.kv_format == "model" and kept.context < 64
    assert tight.kv_format == "float8" and tight.context == 64
    assert f"float8 KV cache: in float32 the budget holds a context of {kept.context:,} positions only" in tight.covers
    assert tight.plan.kv_cache == {
        "format": "float8",
        "context": 64,
        "bytes": 64
        * bytes_per_token(transformers.AutoConfig.from_pretrained(long_context_llama), torch.float32, "float8"),
    }
    assert tight.predicted_peak_bytes == max(tight.plan.phase_peaks.values()) <= 230_000
    prompt = 17
    report = run(
        RunOptions(
            model=str(long_context_llama),
            budget=230_000,
            allow="keep,disk",
            context=64,
            kv_cache="float8",
            max_new_tokens=64 - prompt,  # the run's cache reaches 63 positions, the most the model takes
            repeat=1,
            reference=False,
        )
    )
    assert report.measurement.peak_bytes <= report.predicted_peak_bytes <= 230_000


def test_a_saved_float8_plan_is_carried_out_as_float8(tiny_llama, tmp_path, capsys):
    arguments = ["--model", str(tiny_llama), "--budget", "8MB", "--max-new-tokens", "3", "--kv-cache", "float8"]
    assert main(["fit", *arguments, "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["kv_cache_format"] == "float8" and made["plan"]["kv_cache"]["format"] == "float8"
    (tmp_path / "plan.json").write_text(json.dumps(made))
    report = run(RunOptions(model=str(tiny_llama), plan=tmp_path / "plan.json", max_new_tokens=3, repeat=1))
    assert report.budgeted.kv_format == "float8" and report.measurement.peak_bytes <= report.predicted_peak_bytes


def test_float8_is_refused_where_the_cache_has_sliding_windows_and_for_an_encoder(tmp_path):
    config = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    model = transformers.MistralForCausalLM(config)
    with pytest.raises(ValueError, match=r"kv_cache='float8' stores full-attention layers only.*use kv_cache='model'"):
        cache_argument(model, "float8")
    with pytest.raises(ValueError, match=r"kv_cache applies to causal LMs"):
        plan_only(RunOptions(budget="80MB", kv_cache="float8"))
    with pytest.raises(ValueError, match=r"kv_cache='fp8' is not accepted"):
        RunOptions(kv_cache="fp8")
    with pytest.raises(ValueError, match=r"graph=True: a captured decode keeps a static cache"):
        generate_greedy(model, torch.ones(1, 3, dtype=torch.long), 2, graph=True, kv_format="float8")
