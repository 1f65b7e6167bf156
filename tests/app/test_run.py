"""``tightfit run`` on the built-in all-MiniLM-L6-v2 weights, side by side with
sentence-transformers, and its bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial

import pytest
import torch

from tightfit.app.models import default_model_dir, embed, load_encoder
from tightfit.app.run import DEFAULT_SENTENCES, RunOptions, run
from zoo.commands import side_by_side


@pytest.fixture(scope="module")
def report():
    return run(RunOptions(repeat=2))


def test_run_reports_real_figures(report):
    assert report.backend == "cpu" and report.embedding_dim == 384
    assert 80e6 < report.weights_bytes < 100e6  # 22.7M float32 parameters
    measured = report.measurement
    assert len(measured.seconds) == 2 and measured.median_seconds > 0
    assert measured.peak_bytes > report.weights_bytes
    assert measured.peak_rss_bytes > measured.peak_bytes


def test_most_similar_pairs_make_sense(report):
    first = report.pairs[0]
    assert {first[0], first[1]} == {"A man is eating food.", "A man is eating a piece of bread."}
    assert all(-1.0 <= score <= 1.0 for *_, score in report.pairs)
    scores = [score for *_, score in report.pairs]
    assert scores == sorted(scores, reverse=True)


def test_embeddings_match_sentence_transformers():
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder = default_model_dir()
    reference = sentence_transformers.SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    expected = torch.as_tensor(reference.encode(list(DEFAULT_SENTENCES), normalize_embeddings=True))
    model, tokenizer = load_encoder(folder, torch.device("cpu"))
    ours = embed(model, tokenizer, list(DEFAULT_SENTENCES), torch.device("cpu"))
    cosine = (ours * expected).sum(-1)
    assert cosine.min() > 0.9999


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tightfit.app.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """The real commands the tests read, each in a fresh process, started side by side."""
    with side_by_side(
        {
            "json": partial(_cli, "run", "--repeat", "1", "--json"),
            "nf4": partial(_cli, "run", "--quant", "nf4", "--repeat", "1"),
            "no config": partial(_cli, "run", "--model", str(tmp_path_factory.mktemp("no-config"))),
        }
    ) as runs:
        yield runs


def test_cli_run_json(commands):
    done = commands["json"].result()
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["backend"] == "cpu" and data["embedding_dim"] == 384
    assert data["peak_bytes"] > data["weights_bytes"] > 0 and data["latency_ms_median"] > 0


def test_run_with_float8_storage_offloaded_to_disk():
    report = run(RunOptions(storage_dtype="float8_e4m3fn", offload="disk", repeat=1))
    assert report.changes == "float8_e4m3fn + offload disk"
    assert report.device_weights_bytes == 0  # memory-mapped: nothing held in device memory between forwards
    assert report.weights_bytes < 0.7 * report.full_weights_bytes  # the embeddings (44.7 MiB) stay float32
    assert report.min_cosine_to_full > 0.995  # measured 0.9977
    assert report.measurement.peak_bytes < 0.2 * report.full_weights_bytes


def test_cli_run_reports_storage_and_offload(capsys):
    from tightfit.app.cli import main

    assert main(["run", "--storage-dtype", "float8_e5m2", "--offload", "cpu", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "weights, float8_e5m2" in out and "weights in cpu memory between forwards" in out
    assert "embedding cosine, float8_e5m2 + offload cpu vs full (lowest)" in out


@pytest.fixture(scope="module")
def nf4_reports():
    return {keep: run(RunOptions(quant="nf4", repeat=1, keep_8bit=keep)) for keep in (True, False)}


def test_nf4_keeps_the_later_half_of_the_layers_in_8_bits(nf4_reports):
    kept, all_4bit = nf4_reports[True], nf4_reports[False]
    assert kept.kept_8bit == ("encoder.layer.3", "encoder.layer.4", "encoder.layer.5") and kept.kept_8bit_linears == 18
    assert all_4bit.kept_8bit == () and all_4bit.kept_8bit_linears == 0 and all_4bit.kept_8bit_bytes == 0
    # measured: 0.991 kept, 0.967 all in 4 bits
    assert kept.min_cosine_to_full >= 0.98 > all_4bit.min_cosine_to_full
    # 3 layers x (4 x 384 x 384 + 2 x 384 x 1536) = 5,308,416 weights at one byte, plus scales and float32 biases
    assert 5_308_416 < kept.kept_8bit_bytes < 5_308_416 * 1.02
    assert (
        all_4bit.weights_bytes
        < kept.weights_bytes
        < all_4bit.weights_bytes + kept.kept_8bit_bytes
        < kept.full_weights_bytes
    )


def test_cli_run_nf4_names_the_kept_layers(commands):
    done = commands["nf4"].result()
    assert done.returncode == 0, done.stderr
    assert (
        "kept in 8 bits" in done.stdout
        and "encoder.layer.3, encoder.layer.4, encoder.layer.5: 18 Linear" in done.stdout
    )


def testweights_bytes_count_the_scales_of_quantized_layers():
    from torch import nn

    from tightfit.app.run import weights_bytes
    from tightfit.quant import NF4Config, quantize_

    model = quantize_(nn.Sequential(nn.Linear(64, 128)), NF4Config())
    # 8192 values: 4096 packed bytes, 128 float32 scales, the 16-entry float32 code map, 128 float32 biases
    assert weights_bytes([model]) == 4096 + 128 * 4 + 16 * 4 + 128 * 4
    with pytest.raises(TypeError, match="modules must be list or tuple, got Sequential"):
        weights_bytes(model)
    with pytest.raises(TypeError, match=r"modules\[1\] must be Module, got str"):
        weights_bytes([model, "encoder"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"storage_dtype": "int4"}, ValueError, "storage_dtype='int4' is not accepted"),
        ({"storage_dtype": "float8_e4m3fn", "quant": "nf4"}, ValueError, "choose one"),
        ({"offload": "tape"}, ValueError, "offload='tape' is not accepted"),
        ({"repeat": 0}, ValueError, "repeat must be an int >= 1"),
        ({"repeat": True}, ValueError, "repeat must be an int >= 1"),
        ({"top_pairs": -2}, ValueError, "top_pairs must be an int >= 1"),
        ({"model": 7}, TypeError, "model must be a folder path"),
        ({"backend": 3}, TypeError, "backend must be a str"),
        ({"keep_8bit": "yes"}, TypeError, "keep_8bit must be a bool"),
        ({"sentences": ("only one",)}, ValueError, "at least two non-empty strings"),
        ({"sentences": ["a", "b"]}, ValueError, "sentences must be a tuple"),
    ],
)
def test_run_options_reject_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        RunOptions(**kwargs)


def test_run_rejects_missing_or_bad_model_folder(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        run(RunOptions(model=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="has no config.json"):
        run(RunOptions(model=str(tmp_path)))
    with pytest.raises(ValueError, match="backend 'nonesuch' is not known"):
        run(RunOptions(backend="nonesuch"))
    with pytest.raises(TypeError, match="options must be RunOptions"):
        run({"repeat": 1})


def test_cli_reports_errors_without_a_traceback(commands):
    done = commands["no config"].result()
    assert done.returncode == 2
    assert done.stderr.startswith("tightfit run: error: --model=") and "has no config.json" in done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""
