"""Stage plans made before any weight is read: the cut model computes what the whole model
computes, stages chained in one process; every stage within its budget; a budget no single
process holds planned over two ranks; refusals naming the rank; bad inputs refused."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tightfit.app.models import default_model_dir, embed, load_tokenizer, save_causal_lm
from tightfit.app.run import DEFAULT_SENTENCES
from tightfit.app.stages_command import stage_budgets
from tightfit.distributed import (
    Ranks,
    StagePlan,
    plan_stages,
    process_group,
    rank_device,
    ranks_from_environment,
    shared_inputs,
)
from tightfit.distributed.plan import micro_batch_rows
from tightfit.distributed.pricing import Hop, device_hop, measured_hops
from tightfit.distributed.split import cut, layout_of
from tightfit.fitting import FitError
from tightfit.loading import load
from tightfit.loading.folder import skeleton

LM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
PROMPT = {"input_ids": torch.tensor([[5, 17, 99, 2000, 7, 12]])}
HOP = Hop(1e-4, 1e9, "a test's link")


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("stages-lm"), **LM, seed=1)


def _loaded_stages(folder, plan):
    stages = []
    for stage in plan.stages:
        model, _ = skeleton(folder, plan.kind)
        cut(model, plan.kind, stage.start, stage.end)
        stages.append(load(folder, plan=stage.plan, model=model, kind=plan.kind)[0])
    return stages


def test_causal_lm_stages_chained_generate_the_whole_models_tokens(lm_folder):
    from tightfit.app.generation import generate_greedy
    from tightfit.app.kv_cache import cache_argument

    plan = plan_stages(lm_folder, ["12MB", "3MB", "12MB"], PROMPT, max_new_tokens=6)
    assert all(s.predicted_peak_bytes <= s.budget_bytes for s in plan.stages)
    stages = _loaded_stages(lm_folder, plan)
    whole = load(lm_folder, "100MB")[0]
    expected = generate_greedy(whole, PROMPT["input_ids"], 6).tokens
    caches = [cache_argument(stage) for stage in stages]
    tokens, step = [], PROMPT["input_ids"]
    with torch.inference_mode():
        for _ in range(6):
            hidden = stages[0](input_ids=step, use_cache=True, **caches[0]).logits
            hidden = stages[1](inputs_embeds=hidden, use_cache=True, **caches[1]).logits
            step = stages[2](inputs_embeds=hidden, use_cache=True, **caches[2]).logits[:, -1:].argmax(-1)
            tokens.append(int(step))
    assert tuple(tokens) == expected
    names = [{n for n, _ in stage.named_parameters()} for stage in stages]
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[2]
    middle = plan.stages[1]
    assert all(int(n.split(".")[2]) in range(middle.start, middle.end) for n in names[1])


def test_encoder_stages_embed_as_the_whole_model_chained_and_on_the_devices_of_one_process():
    from tightfit.distributed import run_local

    folder = default_model_dir()
    tokenizer = load_tokenizer(folder)
    batch = tokenizer(list(DEFAULT_SENTENCES), padding=True, return_tensors="pt")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    whole = embed(load(folder, "200MB")[0], tokenizer, list(DEFAULT_SENTENCES), torch.device("cpu"))
    plan = plan_stages(folder, ["60MB", "60MB"], inputs)
    assert plan.kind == "encoder" and len(plan.stages) == 2
    first, second = _loaded_stages(folder, plan)
    with torch.inference_mode():
        hidden = first(**inputs).last_hidden_state
        out = second(inputs_embeds=hidden, attention_mask=inputs["attention_mask"]).last_hidden_state
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    assert torch.equal(torch.nn.functional.normalize((out * mask).sum(1) / mask.sum(1), dim=-1), whole)
    with pytest.raises(ValueError, match="several stages on one device"):
        run_local(folder, plan, inputs)
    # in one process, in 3 micro-batches (3, 3 and 2 rows): the same embeddings, the peak predicted and
    # lower than in one part, the batch's embeddings held
    whole_batch = plan_stages(folder, {"cpu": "120MB"}, inputs)
    parts = plan_stages(folder, {"cpu": "120MB"}, inputs, micro_batches=3)
    assert parts.micro_batch_rows() == [slice(0, 3), slice(3, 6), slice(6, 8)]
    assert parts.stages[0].held_bytes == 8 * 384 * 4 and "in 3 micro-batches" in str(parts)
    run = run_local(folder, parts, inputs, repeat=1)
    torch.testing.assert_close(run.embeddings, whole, rtol=0, atol=1e-6)
    (report,) = run.reports
    assert abs(report.measured_peak_bytes - report.predicted_peak_bytes) <= 4096 and report.within_budget
    assert report.measured_peak_bytes < whole_batch.stages[0].predicted_peak_bytes


def test_a_budget_no_single_process_holds_is_planned_over_two_ranks(lm_folder):
    with pytest.raises(FitError):
        plan_stages(lm_folder, ["10MB"], PROMPT, max_new_tokens=4)
    plan = plan_stages(lm_folder, ["10MB", "10MB"], PROMPT, max_new_tokens=4)
    assert [s.predicted_peak_bytes <= 10**7 for s in plan.stages] == [True, True]
    assert sum(s.read_bytes for s in plan.stages) == plan.checkpoint_bytes
    assert StagePlan.from_json(plan.to_json()) == plan
    table = str(plan)
    assert "embedding, layers 0-1" in table and "layers 2-3, norm, head" in table


def test_a_rank_that_cannot_hold_even_one_layer_is_named(lm_folder):
    with pytest.raises(
        FitError, match=r"rank 1 \(cpu, budget .*\) cannot hold its stage \(layer 3 of 4\).*largest parts: weights of"
    ):
        plan_stages(lm_folder, ["40MB", "1MB"], PROMPT, max_new_tokens=4)


def test_unequal_budgets_move_layers_to_the_rank_with_room(lm_folder):
    plan = plan_stages(lm_folder, ["9MB", "30MB"], PROMPT, max_new_tokens=4)
    assert plan.stages[0].end < plan.stages[1].end - plan.stages[1].start + 1
    assert all(s.predicted_peak_bytes <= s.budget_bytes for s in plan.stages)


@pytest.mark.parametrize(
    ("budgets", "inputs", "kwargs", "error", "match"),
    [
        ("60MB", PROMPT, {}, TypeError, "budgets must be a non-empty list of sizes"),
        ([], PROMPT, {}, TypeError, "budgets must be a non-empty list"),
        ({}, PROMPT, {}, ValueError, "budgets is empty"),
        (["1MB"] * 5, PROMPT, {}, ValueError, "5 ranks for 4 layers"),
        (["1 parsec"], PROMPT, {}, ValueError, r"budgets\[0\]"),
        (["9MB"], {"ids": 1}, {}, ValueError, "inputs must hold 'input_ids'"),
        (["9MB"], {"input_ids": torch.ones(3)}, {}, ValueError, "2-D int64"),
        (["9MB"], PROMPT, {"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        (["9MB"], PROMPT, {"devices": ["cpu", "cpu"]}, ValueError, "one device per budget"),
        (["9MB"], PROMPT, {"kind": "encoder-decoder"}, ValueError, "cannot be cut into stages"),
        (["9MB"], PROMPT, {"allow": "keep"}, TypeError, "allow"),
        (["9MB"], PROMPT, {"max_new_tokens": 0}, ValueError, "give at least 1 token"),
        (["9MB"], {"input_ids": torch.ones(2, 3, dtype=torch.long)}, {}, ValueError, "takes one prompt"),
        (["9MB"], {"input_ids": torch.ones(1, 0, dtype=torch.long)}, {}, ValueError, "at least 1 x 1"),
        (["9MB"], {**PROMPT, "position_ids": PROMPT["input_ids"]}, {}, ValueError, "do not pass on"),
        (["9MB"], PROMPT, {"devices": ["gpu"]}, ValueError, r"devices\[0\]='gpu' is not a device"),
        (["9MB"], PROMPT, {"devices": "cpu"}, TypeError, "must be a list of devices"),
        ({5: "9MB"}, PROMPT, {}, TypeError, "budgets key 5 must be a device"),
        ({"cpu": "9MB", "cpu:0": "9MB"}, PROMPT, {}, ValueError, "names one device twice"),
        (["9MB"], PROMPT, {"hops": [HOP, HOP]}, ValueError, r"one Hop per rank \(1\)"),
        (["9MB"], PROMPT, {"hops": [0.1]}, ValueError, "one Hop per rank"),
        ({"cpu": "9MB"}, PROMPT, {"hops": [HOP]}, ValueError, "priced from their calibrations"),
        (["9MB"], PROMPT, {"micro_batches": 2}, ValueError, "one prompt, one micro-batch"),
        (["9MB"], PROMPT, {"micro_batches": 0}, ValueError, "micro_batches"),
        (["9MB"], PROMPT, {"micro_batches": 1.5}, ValueError, "micro_batches must be an int"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_read(lm_folder, budgets, inputs, kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_stages(lm_folder, budgets, inputs, **({"max_new_tokens": 2} | kwargs))


def test_cut_refuses_a_model_it_cannot_cut_and_a_bad_range(lm_folder):
    with pytest.raises(ValueError, match="model_type None.*accepted for a causal-lm: gemma, llama"):
        layout_of(nn.Linear(2, 2), "causal-lm")
    model, _ = skeleton(lm_folder, "causal-lm")
    for start, end in ((2, 2), (0, 5), (3, 1)):
        with pytest.raises(ValueError, match=r"is not a range of the 4 layers"):
            cut(model, "causal-lm", start, end)


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=200))
def test_a_stage_plan_read_from_any_text_is_a_plan_or_a_clear_error(text):
    try:
        StagePlan.from_json(text)
    except (ValueError, TypeError) as error:
        assert "text" in str(error)


def test_a_stage_plan_with_a_gap_or_a_key_changed_is_refused(lm_folder):
    data = json.loads(plan_stages(lm_folder, ["10MB", "10MB"], PROMPT, max_new_tokens=2).to_json())
    data["stages"][1]["start"] += 1
    with pytest.raises(ValueError, match="must cover layers 0-3 in order"):
        StagePlan.from_json(json.dumps(data))
    data["stages"][1]["start"] -= 1
    data["micro_batches"] = 2
    with pytest.raises(ValueError, match="micro_batches=2: .* a generation one"):
        StagePlan.from_json(json.dumps(data))
    data["micro_batches"] = 1
    data["stages"][0]["extra"] = 1
    with pytest.raises(ValueError, match="each stage holds"):
        StagePlan.from_json(json.dumps(data))


def test_sends_are_priced_per_hop_in_the_plans_time_model(lm_folder):
    unpriced = plan_stages(lm_folder, ["10MB", "10MB"], PROMPT, max_new_tokens=4)
    assert [s.send_seconds for s in unpriced.stages] == [None, None] and unpriced.send_seconds is None
    assert "not priced" in str(unpriced)
    hops = [Hop(1e-4, 1e9, "to rank 1: a test's link"), Hop(2e-4, 5e8, "to rank 0: a test's link")]
    plan = plan_stages(lm_folder, ["10MB", "10MB"], PROMPT, max_new_tokens=4, hops=hops)
    hidden = LM["hidden_size"] * 4  # float32
    # rank 0: the prefill's hidden states, then one position per decode step; rank 1: 3 tokens back
    assert plan.stages[0].send_seconds == pytest.approx(4 * 1e-4 + (6 * hidden + 3 * hidden) / 1e9)
    assert plan.stages[1].send_seconds == pytest.approx(3 * (2e-4 + 8 / 5e8))
    assert plan.predicted_seconds == pytest.approx(unpriced.predicted_seconds + plan.send_seconds)
    assert "rank 1 to rank 0: a test's link" in str(plan) and "+ sends" in str(plan)
    assert StagePlan.from_json(plan.to_json()) == plan
    single = plan_stages(lm_folder, {"cpu": "30MB"}, PROMPT, max_new_tokens=4)
    assert single.stages[0].send_seconds == 0.0 and single.transfers == "none: one stage"


def test_a_pipeline_is_predicted_filled_then_at_its_busiest_stage_including_what_it_receives(lm_folder):
    folder = default_model_dir()
    batch = load_tokenizer(folder)(list(DEFAULT_SENTENCES), padding=True, return_tensors="pt")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    hops = [Hop(1e-3, 1e6, "a slow link"), Hop(1e-3, 1e6, "a slow link")]
    plan = plan_stages(folder, ["60MB", "60MB"], inputs, micro_batches=4, hops=hops)
    first, last = plan.stages
    each = [(s.compute_seconds + s.send_seconds) / 4 for s in plan.stages]
    busiest = max(each[0], each[1] + first.send_seconds / 4)  # the last stage waits through its receives
    assert plan.predicted_seconds == pytest.approx(sum(each) + 3 * busiest)
    assert last.held_bytes == 8 * 384 * 4  # float32 embeddings, whatever the model's dtype
    with pytest.raises(ValueError, match="parts=9 micro-batches of a batch of 8 rows"):
        micro_batch_rows(8, 9)
    with pytest.raises(ValueError, match="parts"):
        micro_batch_rows(8, 0)


def test_copies_between_devices_are_priced_at_each_accelerators_link():
    figures = {"cuda:0": {"host_to_device_bandwidth": 2e10}, "cuda:1": {"host_to_device_bandwidth": 1e10}}
    assert device_hop("cuda:0", "cpu", figures).seconds([(1, 10**9)]) == pytest.approx(0.05)
    assert device_hop("cuda:0", "cuda:1", figures).seconds([(2, 10**9)]) == pytest.approx(2 * (0.05 + 0.1))
    with pytest.raises(ValueError, match="calibration of xpu:0 has no host_to_device_bandwidth"):
        device_hop("cpu", "xpu:0", figures | {"xpu:0": {"host_to_device_bandwidth": None}})
    for bad in ({"latency_seconds": -1.0}, {"bytes_per_second": 0.0}, {"bytes_per_second": float("nan")}):
        with pytest.raises(ValueError, match="Hop.(latency_seconds|bytes_per_second)"):
            Hop(**({"latency_seconds": 0.0, "bytes_per_second": 1.0, "how": "x"} | bad))


def test_budget_option_gives_every_rank_one_size_or_one_each():
    assert stage_budgets("60MB", 3) == ["60MB"] * 3
    assert stage_budgets("50MB, 70MB", 2) == ["50MB", "70MB"]
    with pytest.raises(ValueError, match="names 3 sizes for 2 ranks"):
        stage_budgets("1MB,2MB,3MB", 2)
    with pytest.raises(TypeError, match="text must be"):
        stage_budgets(5, 2)
    with pytest.raises(ValueError, match="ranks must be"):
        stage_budgets("60MB", 0)


def test_each_rank_takes_the_device_of_its_local_rank():
    assert rank_device("cpu", 3) == "cpu"
    if torch.cuda.is_available():
        assert rank_device("cuda", 0) == "cuda:0"


def test_budget_option_per_device_runs_in_one_process():
    assert stage_budgets("cuda:0=20GB, cpu=64GB", 1) == {"cuda:0": "20GB", "cpu": "64GB"}
    with pytest.raises(ValueError, match="names a device twice"):
        stage_budgets("cpu=1GB,cpu=2GB", 1)
    with pytest.raises(ValueError, match="DEVICE=SIZE for each device"):
        stage_budgets("cpu=1GB,2GB", 1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--device", "cuda:0"], "must be a device type without an index"),
        (["--device", "nope"], "device_type='nope'"),
        (["--budget", "cpu=60MB", "--device", "cuda"], "--device is for ranks"),
        (["--sentences", "missing.txt"], "--sentences 'missing.txt' cannot be read"),
        (["--sentences", "blank.txt"], "holds no sentence"),
        (["--sentences", "binary.txt"], "is not valid UTF-8"),
        (["--micro-batches", "9"], "more than the batch's 8 rows"),
        (["--micro-batches", "0"], "micro_batches must be an int >= 1"),
    ],
)
def test_stages_options_given_wrong_are_one_line_and_exit_2(options, message, tmp_path, monkeypatch, capsys):
    from tightfit.app import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00sentence")
    budget = [] if "--budget" in options else ["--budget", "60MB"]
    assert cli.main(["stages", *budget, "--ranks", "2", "--plan-only", *options]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_local_rank_from_the_launcher_is_one_line(monkeypatch, capsys):
    from tightfit.app import cli

    monkeypatch.setenv("LOCAL_RANK", "first")
    assert cli.main(["stages", "--budget", "60MB", "--ranks", "2", "--plan-only"]) == 2
    assert "LOCAL_RANK='first' must be an integer >= 0" in capsys.readouterr().err


def test_a_model_type_whose_stages_were_not_checked_is_refused(lm_folder):
    model, _ = skeleton(lm_folder, "causal-lm")
    model.config.model_type = "granite"  # scales its embeddings in the model's forward
    with pytest.raises(ValueError, match="model_type 'granite'.*accepted for a causal-lm: gemma, llama"):
        cut(model, "causal-lm", 0, 2)


def test_when_shares_in_proportion_do_not_fit_the_layers_are_filled_front_to_back(lm_folder):
    from tightfit.distributed.plan import _filled

    peaks = {(0, 1): 5, (0, 2): 9, (0, 3): 20, (1, 2): 4, (1, 3): 8, (2, 3): 4, (1, 4): 30, (2, 4): 9, (3, 4): 5}
    budgets = [9, 4, 9]

    def stage_fit(rank, start, end):
        fits = peaks[(start, end)] <= budgets[rank]
        return (
            FitPlanStub(peaks[(start, end)])
            if fits
            else FitError("over", budget_bytes=1, smallest_peak_bytes=2, parts=[])
        )

    bounds, _ = _filled(stage_fit, 3, 4)
    assert bounds == [0, 2, 3, 4]
    budgets[2] = 4  # the last rank cannot hold even its one layer and the head
    bounds, where = _filled(stage_fit, 3, 4)
    assert bounds is None and where == (2, 3, 4)


class FitPlanStub:
    def __init__(self, peak):
        self.predicted_peak_bytes = peak


def test_a_plan_runs_only_on_the_inputs_it_was_made_for(lm_folder):
    plan = plan_stages(lm_folder, ["40MB"], PROMPT, max_new_tokens=2)
    plan.check_run(PROMPT, 2)
    with pytest.raises(ValueError, match=r"made for input_ids of shape \(1, 6\) and max_new_tokens=2; this run has"):
        plan.check_run({"input_ids": torch.ones(1, 300, dtype=torch.long)}, 2)
    with pytest.raises(ValueError, match="plan it again"):
        plan.check_run(PROMPT, 100)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: Ranks(1, 1), ValueError, "Ranks.rank=1 must be below Ranks.world=1"),
        (lambda: Ranks(-1, 2), ValueError, "Ranks.rank"),
        (lambda: ranks_from_environment({"RANK": "3", "WORLD_SIZE": "2"}), ValueError, "RANK=3, WORLD_SIZE=2"),
        (lambda: ranks_from_environment(None), TypeError, "environ"),
        (lambda: process_group(Ranks(0, 1), float("inf")).__enter__(), ValueError, "timeout_seconds must be a finite"),
        (lambda: process_group(None, 5).__enter__(), TypeError, "ranks"),
        (lambda: rank_device("cuda:1", 0), ValueError, "device type without an index"),
        (lambda: rank_device("gpu", 0), ValueError, "device_type='gpu' must be a device type"),
        (lambda: rank_device("cpu", -1), ValueError, "local_rank"),
        (lambda: rank_device("cuda", torch.cuda.device_count()), ValueError, "has no cuda device of its own"),
        (lambda: measured_hops(2, 2, 5.0), ValueError, "rank=2 must be below world=2"),
        (lambda: measured_hops(0, 2, 0), ValueError, "timeout_seconds must be a finite"),
        (lambda: measured_hops(0, 2, 5.0), ValueError, "inside process_group"),
        (lambda: shared_inputs(None, Ranks(0, 1)), TypeError, "inputs"),
    ],
)
def test_ranks_and_process_group_arguments_are_checked(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_run_arguments_are_checked_before_anything_is_read(lm_folder):
    from tightfit.distributed import run_stage

    plan = plan_stages(lm_folder, ["40MB"], PROMPT, max_new_tokens=2)
    with pytest.raises(TypeError, match="inputs must be"):
        run_stage(lm_folder, plan, None, Ranks(0, 1), max_new_tokens=2)
    with pytest.raises(ValueError, match="the plan has 1 stages; this run has 2 ranks"):
        run_stage(lm_folder, plan, PROMPT, Ranks(0, 2), max_new_tokens=2)
    with pytest.raises(ValueError, match="timeout_seconds must be a finite"):
        run_stage(lm_folder, plan, PROMPT, Ranks(0, 1), max_new_tokens=2, timeout_seconds=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=8, max_size=8))
def test_any_header_a_peer_sends_is_a_tensor_a_stage_could_send_or_a_stage_error(values):
    from tightfit.distributed import StageError
    from tightfit.distributed.link import Link

    try:
        dtype, shape = Link(0, 5.0)._announced(torch.tensor(values, dtype=torch.int64), 1)
    except StageError as error:
        assert "rank 1 sent a header no stage makes" in str(error) and error.peer == 1
    else:
        assert all(size >= 0 for size in shape) and torch.Size(shape).numel() * dtype.itemsize <= 1 << 40
