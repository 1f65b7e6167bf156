"""The storage catalogue: the built-in formats' bytes, and a format registered in one
place reaching fit, FitPlan.apply, ``tightfit run --quant`` and ``--allow``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import tightfit
import tightfit.fitting.calibration as calibration
from tightfit.app.cli import main
from tightfit.app.models import save_causal_lm
from tightfit.fitting import Allow, storage_names
from tightfit.quant import (
    Linear4bit,
    LinearInt8,
    QuantConfig,
    StorageFormat,
    quantized_format,
    register_format,
    register_handler,
    storage_format,
    storage_formats,
    unregister_format,
    unregistered_tensors,
)
from zoo.lm import figures


class LinearHalf(nn.Module):
    """A test-only format: the weight stored in bfloat16, decoded per call."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @classmethod
    def transient_bytes(cls, shape: tuple[int, ...], rows: int, outliers: int, dtype: torch.dtype) -> int:
        return math.prod(shape) * dtype.itemsize  # forward decodes the whole weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


@dataclass(frozen=True)
class HalfConfig(QuantConfig):
    pass


@register_handler(HalfConfig)
def _half(linear: nn.Linear, config: HalfConfig) -> nn.Module:
    return LinearHalf(linear)


@pytest.fixture
def half():
    """The format registered for one test, in one place."""
    storage = register_format(
        quantized_format("half", 1, 0.5, HalfConfig(), LinearHalf, lambda shape, dtype: math.prod(shape) * 2)
    )
    yield storage
    unregister_format("half")


def four_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4))).eval()


def test_builtin_formats_and_their_bytes():
    assert storage_names() == ("keep", "bfloat16", "float8", "8bit", "int8", "nf4", "fp4")
    shape, numel = (256, 512), 256 * 512
    expected = {
        "keep": numel * 4,
        "bfloat16": numel * 2,
        "float8": numel + 256 * 4,
        "8bit": numel + 32 * 4 + 256 * 4,
        "int8": numel + 256 * 4,
        "nf4": numel // 2 + numel // 64 * 4 + 16 * 4,
        "fp4": numel // 2 + numel // 64 * 4 + 16 * 4,
    }
    assert {f.name: f.stored_bytes(shape, torch.float32) for f in storage_formats()} == expected
    assert [f.rank for f in storage_formats()] == [0, 1, 2, 2, 2, 3, 4]
    assert [f.name for f in storage_formats() if not f.decodes] == ["keep"]


def test_held_when_offloaded_is_what_a_quantized_layer_keeps_outside_its_buffers():
    linear = nn.Linear(256, 512)
    for name, layer in (("nf4", Linear4bit.from_linear(linear)), ("int8", LinearInt8.from_linear(linear))):
        held = storage_format(name).held_offloaded((512, 256), torch.float32)
        assert held == sum(t.nbytes for t in unregistered_tensors(nn.Sequential(layer)))


def test_the_module_s_transient_bytes_are_what_its_forward_allocates():
    torch.manual_seed(0)
    from tightfit.memory import allocated_peak

    layer = storage_format("nf4").config and Linear4bit.from_linear(nn.Linear(256, 512))
    x = torch.randn(8, 256)
    with torch.inference_mode():
        layer(x)
        peak = allocated_peak(lambda: layer(x))
    output = 8 * 512 * 4
    assert peak - output <= storage_format("nf4").transient_bytes((512, 256), 8, 0, torch.float32) + 16 * 1024


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(name="Half"), ValueError, "name='Half' is not accepted"),
        (dict(rank=-1), ValueError, "rank must be an int >= 0"),
        (dict(stored_bytes=3), TypeError, "stored_bytes must be callable"),
        (dict(decode_probe=None), ValueError, "transient_bytes and decode_probe go together"),
    ],
)
def test_a_bad_format_is_refused(half, change, error, match):
    from dataclasses import replace

    with pytest.raises(error, match=match):
        replace(half, **change)


def test_registering_twice_and_unregistering_keep_are_refused(half):
    with pytest.raises(ValueError, match="'half' is registered already"):
        register_format(half)
    with pytest.raises(ValueError, match="'keep' cannot be unregistered"):
        unregister_format("keep")
    with pytest.raises(TypeError, match="storage must be StorageFormat"):
        register_format("half")
    with pytest.raises(ValueError, match="storage format 'tape' is not registered; registered: keep, bfloat16, float8"):
        storage_format("tape")
    assert isinstance(storage_format("half"), StorageFormat)


def test_a_registered_format_is_planned_and_applied(half):
    model = four_linears()
    x = torch.randn(8, 256)
    allow = Allow.parse("keep,half,device")
    assert allow.storage == {"keep", "half"}
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures()).full_peak_bytes
    plan = tightfit.fit(
        model, (x,), full - 200 * 1024, allow=allow, calibration=figures()
    )  # 4 x 128 KiB saved, less a decoded copy
    assert [e.storage for e in plan.entries].count("half") >= 2
    assert {e.storage for e in plan.entries} <= {"keep", "half"}
    expected = model(x)
    plan.apply(model)
    halves = [name for name, module in model.named_modules() if isinstance(module, LinearHalf)]
    assert halves == [e.module for e in plan.entries if e.storage == "half"]
    assert torch.allclose(model(x), expected, atol=0.05)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_causal_lm(
        tmp_path_factory.mktemp("tiny-llama"),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def test_a_registered_format_is_a_choice_of_run_quant_and_allow(half, tiny_llama, capsys, monkeypatch, tmp_path):
    assert (
        main(["run", "--model", str(tiny_llama), "--quant", "half", "--repeat", "1", "--max-new-tokens", "2", "--json"])
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["quant"] == "half" and data["token_agreement"] is not None
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))  # calibrated once, with a figure for "half"
    monkeypatch.setattr(
        calibration, "_measure", lambda backend, device: figures(device_name=calibration._device_name(device))
    )
    common = [
        "run",
        "--model",
        str(tiny_llama),
        "--allow",
        "keep,half,device",
        "--repeat",
        "1",
        "--max-new-tokens",
        "2",
        "--json",
    ]
    assert main([*common, "--budget", "1GB"]) == 0
    full = json.loads(capsys.readouterr().out)["predicted_peak_bytes"]
    assert main([*common, "--budget", str(full - 20_000)]) == 0  # the two layers in half save 2 x 18 KiB
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert "half" in {entry["storage"] for entry in plan["entries"]} <= {"keep", "half"}
