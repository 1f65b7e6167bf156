"""``make gpu-check`` proven end to end on the CPU (``--device cpu``: small sizes), so that a
GPU run, rare and short, measures rather than debugs. The tests step is left out here: its
tests run in this suite already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_cpu_mode_writes_every_figure(tmp_path):
    done = _run("--out", str(tmp_path), "--device", "cpu", "--skip", "tests")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("gpu-check: ready: have torch")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {name: step["returncode"] for name, step in summary["steps"].items()} == {
        "calls": 0,
        "cli": 0,
        "decode": 0,
        "quant": 0,
        "optim": 0,
        "train": 0,
        "stages": 0,
    }
    calls = json.loads((tmp_path / "calls.json").read_text())["rows"]
    assert calls["nf4"]["direct_path"] and all(row["host_us_per_call"] > 0 for row in calls.values())
    cli = json.loads((tmp_path / "cli.json").read_text())["rows"]["budget 50%"]
    assert (
        cli["decode_tokens_per_second"] > 0
        and max(cli["peak_bytes"], cli["predicted_peak_bytes"]) <= cli["budget_bytes"]
    )
    decode = json.loads((tmp_path / "decode.json").read_text())["rows"]
    for row in ("transformers", "tightfit", "tightfit nf4", "tightfit budget 50%", "accelerate budget 50%"):
        assert decode[row]["decode_tokens_per_second"] > 0, (row, decode[row])
    assert decode["tightfit budget 50%"]["predicted_peak_bytes"] <= decode["tightfit budget 50%"]["budget_bytes"]
    quant = json.loads((tmp_path / "quant.json").read_text())["rows"]
    assert {row["op"].split()[0] for row in quant} >= {"quantize_4bit", "dequantize_4bit", "matmul_4bit"}
    assert all(row["tightfit_ms"] > 0 for row in quant)
    optim = json.loads((tmp_path / "optim.json").read_text())["rows"]
    assert {row["implementation"] for row in optim} >= {"tightfit 8-bit", "torch Adam fused"}
    training = (tmp_path / "train_fit.md").read_text()
    assert "| full fine-tune | 60% |" in training and "| yes |" in training
    stages = (tmp_path / "stages.md").read_text()
    assert "| tightfit, one process |" in stages and "| yes |" in stages
    markdown = (tmp_path / "summary.md").read_text()
    assert "## decode (exit 0" in markdown and "| tightfit nf4 |" in markdown


def test_a_missing_device_is_named_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has the device")
    done = _run("--out", str(tmp_path), "--device", "cuda", timeout=120)
    assert done.returncode == 2
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: NOT READY") and "missing: a cuda device" in lines[0]


def test_bad_arguments_are_refused(tmp_path):
    done = _run("--out", str(tmp_path), "--budget-s", "0", timeout=60)
    assert done.returncode == 2 and "--budget-s must be > 0, got 0.0" in done.stderr
