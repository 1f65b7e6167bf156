"""``tightfit run --budget``: the fit planner chooses, the run measures, the report sets the
prediction against the measurement; on the built-in encoder and on a tiny Llama-style LM."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tightfit.app.cli import main
from tightfit.app.kv_cache import bytes_per_token
from tightfit.app.run import RunOptions, run
from tightfit.fitting import PLACEMENTS, Allow, FitError, storage_names
from zoo.lm import resaved_in_bfloat16

# keys and values of 2 layers, 2 KV heads of 8 dimensions, float32
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


# -- options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "storage", "placement"),
    [
        ("int8,nf4", {"keep", "int8", "nf4"}, set(PLACEMENTS)),  # only storages named: every placement stays
        ("device", set(storage_names()), {"device"}),  # no offloading, every storage
        (
            "keep, Float8 ,disk,",
            {"keep", "float8"},
            {"device", "disk"},
        ),  # keep and device always; case and spaces ignored
    ],
)
def test_allow_names_restrict_only_their_kind(text, storage, placement):
    assert Allow.parse(text) == Allow(storage=frozenset(storage), placement=frozenset(placement))
    assert RunOptions(budget="1MB", allow=text).allow == Allow.parse(text) == Allow.coerce(text)


def test_run_options_parse_the_budget_and_coerce_allow():
    assert RunOptions(budget="40MB").budget == 40_000_000
    assert RunOptions(budget="1.5GiB").budget == 1.5 * 2**30
    assert RunOptions(budget=123).budget == 123
    assert RunOptions(budget="1MB", allow={"storage": {"keep", "int8"}}).allow == Allow(
        storage=frozenset({"keep", "int8"})
    )
    assert RunOptions().budget is None and RunOptions().allow is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"budget": "0"}, ValueError, r"budget='0' is not accepted: a size must be more than 0 bytes"),
        ({"budget": 0}, ValueError, r"budget=0 is not accepted"),
        ({"budget": "-1"}, ValueError, r"budget='-1' is not a size; accepted: a positive int of bytes"),
        ({"budget": -1}, ValueError, r"budget=-1 is not accepted"),
        ({"budget": "abc"}, ValueError, r"budget='abc' is not a size"),
        ({"budget": "1.5XB"}, ValueError, r"budget='1.5XB' is not a size.*KiB, MiB"),
        ({"budget": "nan"}, ValueError, r"budget='nan' is not a size"),
        ({"budget": True}, TypeError, r"budget must be an int or a str, got bool"),
        ({"budget": 1.5e6}, TypeError, r"budget must be an int or a str, got float"),
        ({"budget": "40MB", "quant": "nf4"}, ValueError, r"cannot be combined with quant; drop it"),
        (
            {"budget": "40MB", "storage_dtype": "float16", "offload": "disk"},
            ValueError,
            r"cannot be combined with storage_dtype, offload; drop them",
        ),
        ({"allow": "keep"}, ValueError, r"allow='keep' restricts the fit planner, which runs only with a budget"),
        (
            {"budget": "1MB", "allow": "keep,tape"},
            ValueError,
            r"allow='keep,tape' has 'tape', which is not accepted; accepted: .*disk",
        ),
        ({"budget": "1MB", "allow": " , "}, ValueError, r"allow=' , ' names nothing"),
        ({"budget": "1MB", "allow": {"storage": {"int8"}}}, ValueError, r"lacks 'keep'"),
        ({"budget": "1MB", "allow": 3}, TypeError, r"allow must be None, a str such as 'keep,float8,disk'.*got int: 3"),
    ],
)
def test_run_options_reject_bad_budgets_and_allow(kwargs, error, match):
    with pytest.raises(error, match=match):
        RunOptions(**kwargs)


def test_cli_rejects_bad_budgets_without_a_traceback(capsys):
    for argv, message in (
        (["--budget", "1.5XB"], "--budget='1.5XB' is not a size"),
        (["--budget", "-1"], "--budget='-1' is not a size"),
        (["--budget", "40MB", "--quant", "int8"], "cannot be combined with --quant"),
        (["--allow", "disk"], "runs only with a budget"),
    ):
        assert main(["run", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tightfit run: error: ") and message in err and err.count("\n") == 1


# -- the built-in encoder -------------------------------------------------------------


def test_cli_json_on_the_default_model_fits_the_budget(capsys):
    assert main(["run", "--budget", "40MB", "--repeat", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = data["plan"]
    assert data["budget_bytes"] == 40_000_000 == plan["budget_bytes"]
    assert (
        data["measured_peak_bytes"] == data["allocated_peak_bytes"] <= data["budget_bytes"]
        and data["within_budget"] is True
    )
    assert data["predicted_peak_bytes"] == plan["predicted_peak_bytes"]  # an encoder's run is the planned forward
    assert data["predicted_over_measured"] == pytest.approx(data["predicted_peak_bytes"] / data["measured_peak_bytes"])
    assert 0.99 < data["predicted_over_measured"] < 1.1  # measured 1.002
    assert data["device_weights_bytes"] == plan["predicted_weights_bytes"]  # held_bytes after apply, to the byte
    assert data["applies_nothing"] is False and data["kv_cache_bytes"] == 0
    assert data["prediction_covers"] == "one forward over the 8 sentences (8 x 12 tokens)"
    assert data["min_cosine_to_full"] > 0.99 and data["quality"]["value"] == data["min_cosine_to_full"]
    assert any(entry["placement"] != "device" or entry["storage"] != "keep" for entry in plan["entries"])


def test_allow_restricts_the_storages_on_the_default_model(capsys):
    assert main(["run", "--budget", "40MB", "--allow", "keep,float8,disk", "--repeat", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["allow"] == {
        "storage": ["float8", "keep"],
        "placement": ["device", "disk"],
        "hints": False,
    }  # runs are eager
    assert {entry["storage"] for entry in data["plan"]["entries"]} <= {"keep", "float8"}  # without allow: int8
    assert data["within_budget"] is True


# -- a tiny causal LM -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_report(tiny_llama, tmp_path_factory):
    timeline = tmp_path_factory.mktemp("timeline") / "budget.png" if HAS_MATPLOTLIB else None
    return run(RunOptions(model=str(tiny_llama), budget="4MB", repeat=1, max_new_tokens=6, timeline=timeline))


def test_causal_lm_generation_fits_and_the_prediction_covers_it(lm_report):
    budgeted = lm_report.budgeted
    prompt = lm_report.prompt_tokens
    assert budgeted.context == prompt + 5  # 6 new tokens: 5 fed back after the prefill
    assert budgeted.kv_cache_bytes == budgeted.context * TINY_KV_BYTES_PER_TOKEN
    assert budgeted.plan.budget_bytes == 4_000_000 and budgeted.plan.reserved == {}  # the cache is in the decode trace
    phases = budgeted.plan.phase_peaks
    assert budgeted.predicted_peak_bytes == budgeted.plan.predicted_peak_bytes == max(phases.values()) <= 4_000_000
    assert (
        "prefill forward over the" in budgeted.covers and "last of the 5 one-token decode forwards" in budgeted.covers
    )
    measured = lm_report.measurement.peak_bytes
    assert measured <= lm_report.budget_bytes == 4_000_000
    assert measured <= lm_report.predicted_peak_bytes < 1.1 * measured  # measured 1.0007
    assert lm_report.device_weights_bytes == budgeted.plan.predicted_weights_bytes
    assert lm_report.token_agreement is not None and lm_report.new_tokens == 6
    assert lm_report.time_to_first_token_seconds > 0 and lm_report.changes == "plan for 3.8 MiB"


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs matplotlib (tightfit[plot])")
def test_causal_lm_timeline_is_written(lm_report):
    with open(lm_report.timeline_path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_table_shows_the_plan_and_the_prediction_against_the_measurement(tiny_llama, capsys):
    assert main(["run", "--model", str(tiny_llama), "--budget", "4MB", "--repeat", "1", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "last decode step" in out and "KV cache (model) at 19 positions 4.8 KiB (4,864 B) inside it" in out
    assert "fit plan: LlamaForCausalLM on cpu" in out and "model.embed_tokens" in out
    for row in (
        "budget: predicted against measured",
        "3.8 MiB (4,000,000 B)",
        "predicted peak",
        "predicted / measured",
        "measured within budget",
        "token agreement, plan for 3.8 MiB vs full",
        "the prediction covers the prefill forward over the 17-token prompt",
    ):
        assert row in out


def test_kv_cache_bytes_per_token_reads_the_config(tiny_llama):
    import torch
    from transformers import AutoConfig, GPT2Config

    assert bytes_per_token(AutoConfig.from_pretrained(tiny_llama), torch.float32) == TINY_KV_BYTES_PER_TOKEN
    assert bytes_per_token(GPT2Config(n_layer=2, n_head=4, n_embd=64), torch.float16) == 2 * 2 * 64 * 2


def test_a_budget_above_the_model_s_needs_applies_nothing(tiny_llama, capsys):
    assert main(["run", "--model", str(tiny_llama), "--budget", "1GB", "--repeat", "1", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "budget 953.7 MiB covers the unchanged model" in out and "nothing applied, weights as loaded" in out
    assert "token agreement" not in out and "fit plan:" not in out
    assert (
        main(["run", "--model", str(tiny_llama), "--budget", "1GB", "--repeat", "1", "--max-new-tokens", "4", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["applies_nothing"] is True and data["within_budget"] is True and data["token_agreement"] is None
    assert data["plan"]["kv_cache"]["bytes"] == data["context"] * TINY_KV_BYTES_PER_TOKEN
    assert data["predicted_peak_bytes"] == data["plan"]["full_peak_bytes"]  # the decode step counted in both
    assert data["measured_peak_bytes"] <= data["predicted_peak_bytes"]
    assert all(entry["storage"] == "keep" and entry["placement"] == "device" for entry in data["plan"]["entries"])


def test_allow_is_respected_and_a_budget_nothing_meets_is_a_fit_error(tiny_llama):
    options = RunOptions(model=str(tiny_llama), budget="8MB", allow="keep,disk", repeat=1, max_new_tokens=2)
    assert {(e.storage, e.placement) for e in run(options).budgeted.plan.changed_entries()} == {("keep", "disk")}
    with pytest.raises(
        FitError,
        match=r"^budget=7000000 \(6.7 MiB\) cannot be met on cpu, 4.5 KiB of it for the KV cache at the last decode "
        r"step: the smallest peak the planner reaches with allow='device' is .*Give budget='\d+(\.\d)?MB' or more, "
        r"or allow more than allow='device'$",
    ) as caught:
        run(
            RunOptions(model=str(tiny_llama), budget="7MB", allow="device", max_new_tokens=2)
        )  # the embeddings must stay
    assert caught.value.budget_bytes == 7_000_000 < caught.value.smallest_peak_bytes


def test_weights_stored_in_another_dtype_than_the_config_s_load_within_the_plan_the_dry_run_prints(
    tiny_llama, tmp_path, capsys
):
    # bfloat16 weights under a config naming no dtype (float32): the dry run and the run read the
    # checkpoint's headers and plan the same conversion, and the load stays within its prediction
    folder = resaved_in_bfloat16(tiny_llama, tmp_path / "bf16")
    arguments = ["--model", str(folder), "--budget", "8MB", "--allow", "keep,disk", "--max-new-tokens", "2"]
    assert main(["fit", *arguments, "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    report = run(RunOptions(model=str(folder), budget="8MB", allow="keep,disk", repeat=1, max_new_tokens=2))
    plan = report.budgeted.plan
    assert plan.to_dict()["entries"] == dry["plan"]["entries"]
    assert dry["plan"]["predicted_load_peak_bytes"] == plan.predicted_load_peak_bytes
    assert any("converted from the checkpoint's dtype" in entry.why for entry in plan.entries)
    assert report.load_peak_bytes <= plan.predicted_load_peak_bytes <= 1.01 * report.load_peak_bytes
    assert report.measured_peak_bytes <= report.budget_bytes


def test_cli_no_fit_exits_non_zero_with_the_fit_error_also_under_python_O(tiny_llama):
    done = subprocess.run(
        [sys.executable, "-O", "-m", "tightfit.app.cli", "run", "--model", str(tiny_llama), "--budget", "100KB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("tightfit run: error: --budget=100000 ") and done.stderr.count("\n") == 1
    assert "cannot be met on cpu" in done.stderr and "dominated by" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_budget_below_the_kv_cache_is_refused(tiny_llama):
    with pytest.raises(
        ValueError,
        match=r"^budget=200 \(200 B\) leaves nothing for the model: the KV cache at 18 positions alone needs "
        r"4.5 KiB \(4,608 B\); give a shorter prompt, a smaller max_new_tokens or a larger budget$",
    ):
        run(RunOptions(model=str(tiny_llama), budget=200, max_new_tokens=2))
