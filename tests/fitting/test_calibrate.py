"""The time model's figures: validated, cached by backend, device and torch version, re-measured on request."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tightfit.fitting.calibration as calibrate_impl
from tightfit.fitting import Calibration, calibrate
from tightfit.fitting.calibration import cache_path
from zoo.lm import figures


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Measuring replaced by a counter returning fixed figures; the cache in a fresh folder."""
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(backend, device):
        calls.append(device)
        return figures(
            device_name=calibrate_impl._device_name(device), matmul_flops=1e9 + len(calls), cached_read_bandwidth=2e10
        )

    monkeypatch.setattr(calibrate_impl, "_measure", fake_measure)
    return calls


def test_measured_once_then_read_from_the_cache(counted, tmp_path):
    first = calibrate("cpu")
    second = calibrate("cpu")
    assert len(counted) == 1 and first == second
    files = list(tmp_path.iterdir())
    assert (
        len(files) == 1
        and torch.__version__.replace("+", "-") in files[0].name
        and files[0].name.startswith("calibration-cpu-")
    )
    assert json.loads(files[0].read_text())["matmul_flops"] == first.matmul_flops


def test_remeasure_measures_again(counted):
    first = calibrate("cpu")
    again = calibrate("cpu", remeasure=True)
    assert len(counted) == 2 and again.matmul_flops != first.matmul_flops
    assert calibrate("cpu") == again


def test_a_damaged_cache_is_measured_again(counted):
    calibrate("cpu")
    path = next(iter(cache_path("cpu", calibrate_impl._device_name(torch.device("cpu"))).parent.iterdir()))
    path.write_text("{not json")
    calibrate("cpu")
    assert len(counted) == 2


def test_the_cache_key_names_backend_device_and_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))
    path = cache_path("cuda", "NVIDIA H100 80GB HBM3")
    assert path.parent == tmp_path
    assert path.name.startswith("calibration-cuda-NVIDIA-H100-80GB-HBM3-torch")


def test_real_measurement_gives_valid_figures_under_its_own_progress(measured_calibration):
    figures_now, tasks = measured_calibration
    assert tasks[0].startswith("calibrating cpu: preparing the decode probes")
    assert re.fullmatch(r"calibrating cpu \(once, about \d+ s\)", tasks[1]), tasks
    assert figures_now.host_to_device_bandwidth is None
    assert figures_now.matmul_flops > 0 and figures_now.disk_bandwidth > 0
    assert set(figures_now.decode_seconds) == {"bfloat16", "float8", "8bit", "int8", "nf4", "fp4"}
    # one-token figures per compute dtype; bfloat16 storage of a bfloat16 layer changes nothing, and has none
    assert set(figures_now.token_seconds) == {"bfloat16", "float32"}
    assert set(figures_now.token_seconds["float32"]) == {"keep", "bfloat16", "float8", "8bit", "int8", "nf4", "fp4"}
    assert set(figures_now.token_seconds["bfloat16"]) == {"keep", "float8", "8bit", "int8", "nf4", "fp4"}
    # an AdamW step per value, 8-bit and 32-bit state (the training plan's optimizer time)
    assert set(figures_now.optimizer_seconds) == {"8", "32"} and all(figures_now.optimizer_seconds.values())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(matmul_flops=0), "matmul_flops must be a finite number > 0"),
        (dict(disk_bandwidth=float("nan")), "disk_bandwidth must be a finite number > 0"),
        (dict(device_bandwidth=True), "device_bandwidth must be a finite number > 0"),
        (dict(decode_seconds={"float8": 0.0}), "decode_seconds lacks"),
        (
            dict(decode_seconds={"bfloat16": 0, "float8": -1, "8bit": 0, "int8": 0, "nf4": 0, "fp4": 0}),
            r"decode_seconds\['float8'\] must be",
        ),
        (
            dict(decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 0, "nf4": 0, "fp4": 0, "gguf": 0}),
            "decode_seconds has unknown storage\\(s\\) 'gguf'; accepted: bfloat16, float8, 8bit, int8, nf4, fp4",
        ),
        (
            dict(decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 0, "nf4": 0, "fp4": 0, "keep": 0}),
            "decode_seconds has unknown storage\\(s\\) 'keep'",
        ),
        (dict(optimizer_seconds={"4": 1e-9}), "optimizer_seconds has unknown key '4'; accepted: 8, 32"),
        (dict(optimizer_seconds={"8": 0}), r"optimizer_seconds\['8'\] must be a finite number > 0"),
    ],
)
def test_bad_figures_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        figures(**change)


@pytest.mark.parametrize(
    "token_seconds, error, message",
    [
        (
            {"keep": 1e-10},
            ValueError,
            "token_seconds has unknown dtype 'keep'",
        ),  # one dtype's figures, as cached before
        ({"float32": 1e-10}, TypeError, r"token_seconds\['float32'\] must be dict"),
        (
            {"bf16": {"keep": 1e-10}},
            ValueError,
            "token_seconds has unknown dtype 'bf16'; accepted: a torch dtype's name",
        ),
        ({"float32": {"gguf": 1e-10}}, ValueError, r"token_seconds\['float32'\] has unknown storage 'gguf'"),
        ({"float32": {"keep": 0}}, ValueError, r"token_seconds\['float32'\]\['keep'\] must be a finite number > 0"),
        ({"float32": {"keep": True}}, ValueError, r"token_seconds\['float32'\]\['keep'\] must be a finite number"),
        ([], TypeError, "token_seconds must be dict"),
    ],
)
def test_bad_one_token_figures_rejected(token_seconds, error, message):
    with pytest.raises(error, match=message):
        figures(token_seconds=token_seconds)


def test_round_trip_and_unknown_keys():
    figs = figures()
    assert Calibration.from_dict(figs.to_dict()) == figs
    with pytest.raises(ValueError, match="unknown keys"):
        Calibration.from_dict({**figs.to_dict(), "speed": 1})
    with pytest.raises(TypeError, match="remeasure must be bool"):
        calibrate("cpu", remeasure="yes")


def test_fixed_figures_are_the_same_everywhere_and_still_checked():
    fixed = Calibration.fixed(disk_bandwidth=2e9)
    assert (fixed.device_name, fixed.matmul_flops, fixed.disk_bandwidth) == ("fixed", 1e10, 2e9)
    assert fixed == Calibration.fixed(disk_bandwidth=2e9)
    with pytest.raises(ValueError, match="disk_bandwidth must be a finite number > 0"):
        Calibration.fixed(disk_bandwidth=0)
