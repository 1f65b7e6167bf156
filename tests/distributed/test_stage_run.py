"""Stage runs across processes on gloo (localhost): two ranks started by torchrun, with the
command as a user types it, generate the tokens one process generates, each within its
budget, each reading only its stage's tensors; a rank that dies ends every other rank with
an error naming it, in bounded time."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tightfit.app.generation import generate_greedy
from tightfit.app.models import default_model_dir, embed, load_tokenizer, save_causal_lm
from tightfit.app.run import DEFAULT_SENTENCES
from tightfit.loading import load

SCRIPT = Path(__file__).with_name("rank_script.py")
LM = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
PROMPT = torch.tensor([[5, 17, 99, 2000, 7, 12, 40, 41]])
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("stage-run-lm"), **LM, seed=2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spawn(folder, tmp_path, budgets, *, fault=None, timeout=30.0, inputs=None, options=()):
    """Start one process per budget as torchrun would (the environment it sets), on
    ``inputs`` (default: the prompt, generating); with ``fault`` (rank, "die" or "hang",
    N), that rank exits or stops answering at its N-th send. Returns (processes, rank 0's
    output file)."""
    given = inputs
    inputs = tmp_path / "inputs.pt"
    torch.save(given or {"input_ids": PROMPT}, inputs)
    out = tmp_path / "run.pt"
    port = _free_port()
    processes = []
    for rank in range(len(budgets)):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(budgets)), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        command = [sys.executable, str(SCRIPT), str(folder), str(out), "--budgets", *budgets, "--inputs", str(inputs)]
        command += ["--max-new-tokens", str(0 if given else NEW_TOKENS), "--timeout", str(timeout), *options]
        if fault is not None and fault[0] == rank:
            command += [f"--{fault[1]}-at-send", str(fault[2])]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return processes, out


def test_a_rank_that_dies_ends_every_other_rank_with_an_error_naming_it(lm_folder, tmp_path):
    processes, _ = _spawn(lm_folder, tmp_path, ["25MB", "25MB"], fault=(1, "die", 3), timeout=20.0)
    start = time.monotonic()
    _, err = processes[0].communicate(timeout=60)
    elapsed = time.monotonic() - start
    processes[1].communicate(timeout=10)
    assert processes[1].returncode == 9
    assert processes[0].returncode != 0
    assert "StageError: rank 0: rank 1 stopped (its connection closed)" in err, err[-2000:]
    assert elapsed < 45


def test_two_ranks_under_torchrun_generate_the_single_process_tokens_within_their_budgets(lm_folder):
    """The command as a user types it; each rank reads its own tensors only."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python"]
    command += [str(Path(sys.executable).with_name("tightfit")), "stages", "--model", str(lm_folder)]
    command += ["--budget", "25MB", "--max-new-tokens", str(NEW_TOKENS), "--repeat", "1", "--json"]
    command += ["--prompt", "Once upon a time"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout)
    whole = load(lm_folder, "200MB")[0]
    prompt = load_tokenizer(lm_folder)("Once upon a time", return_tensors="pt")["input_ids"]
    assert tuple(run["tokens"]) == generate_greedy(whole, prompt, NEW_TOKENS).tokens
    full_bytes = sum(t.nbytes for t in whole.state_dict().values())
    assert [s["rank"] for s in run["plan"]["stages"]] == [0, 1]
    # the links were measured when the ranks met, and the sends priced with them
    assert run["plan"]["transfers"].startswith("priced per hop: rank 0 to rank 1: ")
    assert all(s["send_seconds"] > 0 for s in run["plan"]["stages"])
    for report in run["reports"]:
        assert report["measured_peak_bytes"] <= report["budget_bytes"] < full_bytes
        assert report["load_peak_bytes"] <= report["predicted_load_peak_bytes"] <= report["budget_bytes"]
        assert report["sent_bytes"] == report["predicted_sent_bytes"] > 0
        assert abs(report["measured_peak_bytes"] / report["predicted_peak_bytes"] - 1) < 0.02
        # the process's read calls while loading: its own tensors, and less than another stage's
        assert report["stage_read_bytes"] <= report["read_bytes"] < report["stage_read_bytes"] + 4 * 2**20
        assert report["stage_read_bytes"] < 0.7 * full_bytes


def test_two_ranks_embed_in_micro_batches_as_the_whole_model_each_within_its_plan(tmp_path):
    folder = default_model_dir()
    tokenizer = load_tokenizer(folder)
    batch = tokenizer(list(DEFAULT_SENTENCES), padding=True, return_tensors="pt")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    processes, out = _spawn(folder, tmp_path, ["60MB", "60MB"], inputs=inputs, options=["--micro-batches", "3"])
    for process in processes:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
    saved = torch.load(out)
    whole = embed(load(folder, "200MB")[0], tokenizer, list(DEFAULT_SENTENCES), torch.device("cpu"))
    torch.testing.assert_close(saved["embeddings"], whole, rtol=0, atol=1e-6)
    for report in saved["run"]["reports"]:
        # to within a page: the last rank's batch of embeddings held across parts (12 KiB) shows
        assert abs(report["measured_peak_bytes"] - report["predicted_peak_bytes"]) <= 4096
        assert report["measured_peak_bytes"] <= report["budget_bytes"]
        assert report["sent_bytes"] == report["predicted_sent_bytes"]


def test_a_rank_that_stops_answering_ends_the_waiting_rank_after_the_timeout(lm_folder, tmp_path):
    start = time.monotonic()
    processes, _ = _spawn(lm_folder, tmp_path, ["25MB", "25MB"], fault=(1, "hang", 3), timeout=3.0)
    try:
        _, err = processes[0].communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        processes[1].kill()
        processes[1].communicate()
    assert processes[0].returncode != 0
    assert "StageError: rank 0: rank 1 did not answer within 3 s while waiting for the next token" in err, err[-2000:]
    assert elapsed < 45  # start-up, planning and loading, a step, then the 3 s
