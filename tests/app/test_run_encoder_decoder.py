"""``tightfit run`` on an encoder-decoder (a tiny T5 with random weights): greedy tokens as
transformers' ``generate`` makes them, and within a budget, the decoder's cache planned."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from tightfit.app.generation import generate_seq2seq
from tightfit.app.models import default_model_dir, load_tokenizer
from tightfit.app.output import print_report
from tightfit.app.run import RunOptions, plan_only, run

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5")
    tokenizer = load_tokenizer(default_model_dir())
    config = transformers.T5Config(
        vocab_size=len(tokenizer),
        d_model=64,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        d_kv=16,
        initializer_factor=20.0,  # random weights that do not all predict the pad token
        decoder_start_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.sep_token_id,
        architectures=["T5ForConditionalGeneration"],
    )
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_greedy_tokens_are_generates(t5_folder):
    model = transformers.T5ForConditionalGeneration.from_pretrained(t5_folder).eval()
    ids = load_tokenizer(t5_folder)("Once upon a time", return_tensors="pt").input_ids
    ours = generate_seq2seq(model, ids, 6).tokens
    theirs = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)[0, 1:]
    assert list(ours) == theirs.tolist() and len(set(ours)) > 1


def test_a_run_generates_and_reports_as_an_encoder_decoder(t5_folder):
    report = run(RunOptions(model=str(t5_folder), repeat=1, max_new_tokens=5))
    assert report.kind == "encoder-decoder" and report.new_tokens == 5 and report.generated_text
    assert report.decode_tokens_per_second > 0 and report.decode_graph is False
    console = Console(file=io.StringIO(), width=160)
    print_report(report, console)
    assert "(encoder-decoder)" in console.file.getvalue() and "greedy generation" in console.file.getvalue()


def test_within_a_budget_the_decoders_cache_is_planned_and_the_run_stays_within(t5_folder):
    weights = sum(path.stat().st_size for path in t5_folder.glob("*.safetensors"))
    budget = weights // 4  # the tied embedding cannot stay on the device
    report = run(RunOptions(model=str(t5_folder), repeat=1, max_new_tokens=6, budget=budget))
    plan = report.budgeted.plan
    assert report.measured_peak_bytes <= budget and plan.kv_cache == {
        "format": "model",
        "context": 6,
        "bytes": 6 * 2 * 2 * 4 * 16 * 4,  # positions x K,V x layers x heads x d_kv x float32
    }
    assert abs(report.predicted_peak_bytes / report.measured_peak_bytes - 1) < 0.01
    assert report.quality == 1.0  # placements only: every value as stored
    assert "last of the 5 one-token decode forwards, its self-attention cache at 6 positions" in report.budgeted.covers


def test_a_causal_lms_options_are_refused_naming_the_kind(t5_folder):
    with pytest.raises(
        ValueError, match=r"context applies to causal LMs; model=.* is an encoder-decoder, which generates"
    ):
        plan_only(RunOptions(model=str(t5_folder), budget="4MB", context=64))


@pytest.mark.parametrize("new_tokens", [0, -1, True, 2.0, "3"])
def test_generation_refuses_a_bad_number_of_tokens(t5_folder, new_tokens):
    model = transformers.T5ForConditionalGeneration.from_pretrained(t5_folder).eval()
    ids = torch.tensor([[101, 2000, 102]])
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1, got"):
        generate_seq2seq(model, ids, new_tokens)
    with pytest.raises(ValueError, match=r"input_ids must be a \(1, n >= 1\) int64 tensor"):
        generate_seq2seq(model, ids.float(), 2)
