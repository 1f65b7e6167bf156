"""tightfit.save writes a fitted model as a folder that tightfit.load reads back with its
plan, no calibration and no conversion: the reloaded model's logits equal the saved
one's bit for bit, for every storage and placement; and what cannot be saved or reloaded
so is refused, saying why."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

import tightfit
from tightfit.backends.resolve import ResolvedBackend
from tightfit.fitting import held_bytes
from tightfit.loading import Checkpoint
from tightfit.loading import prequantized as loading
from tightfit.loading import stream as streaming
from tightfit.quant import QuantState
from zoo.lm import figures
from zoo.peer import PeerCheck, spec_model

transformers = pytest.importorskip("transformers")

IDS = torch.arange(3, 15).unsqueeze(0)
INPUTS = {"input_ids": IDS}


def logits(model):
    with torch.inference_mode():
        return model(IDS).logits


def no_planning(*args, **kwargs):
    raise AssertionError("a saved folder was planned again")


@pytest.mark.parametrize(
    ("budget", "allow", "shard"),
    [
        (9_320_000, {"storage": ["keep", "nf4"], "placement": ["device"]}, "5GB"),
        (9_320_000, {"storage": ["keep", "fp4"], "placement": ["device"]}, "5GB"),
        (9_320_000, {"storage": ["keep", "8bit"], "placement": ["device"]}, "5GB"),
        (9_320_000, {"storage": ["keep", "int8"], "placement": ["device"]}, "5GB"),
        (9_320_000, {"storage": ["keep", "float8"], "placement": ["device"]}, "5GB"),
        (5_000_000, None, "5GB"),  # the vocabulary's two tables on disk
        (9_320_000, {"storage": ["keep", "nf4"], "placement": ["device"]}, "1MB"),  # shards and their index
    ],
)
def test_save_then_load_is_bit_identical_with_the_saved_plan(tiny_llama, tmp_path, monkeypatch, budget, allow, shard):
    model, plan = tightfit.load(tiny_llama, budget, example_inputs=INPUTS, calibration=figures(), allow=allow)
    assert plan.changed_entries()
    expected = logits(model)
    folder = tightfit.save(model, plan, tmp_path / "saved", source=tiny_llama, max_shard_size=shard)
    assert (folder / "model.safetensors.index.json").is_file() == (shard == "1MB")
    assert {"config.json", "tightfit-plan.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    monkeypatch.setattr(loading, "fit", no_planning)
    reloaded, saved = tightfit.load(folder)
    assert saved == plan
    assert torch.equal(logits(reloaded), expected)
    assert held_bytes(reloaded, "cpu") == plan.predicted_weights_bytes


def test_a_bitsandbytes_model_saves_and_both_libraries_read_it_back(tiny_llama, tmp_path):
    pytest.importorskip("bitsandbytes")
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    quantized = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=config)
    quantized.save_pretrained(tmp_path / "bnb")
    model, plan = tightfit.load(tmp_path / "bnb", 5_000_000, example_inputs=INPUTS, calibration=figures())
    assert torch.equal(logits(model), logits(spec_model(tmp_path / "bnb")))
    folder = tightfit.save(model, plan, tmp_path / "saved")
    reloaded, _ = tightfit.load(folder)
    assert torch.equal(logits(reloaded), logits(model))
    expected = logits(spec_model(folder))
    assert torch.equal(expected, logits(model))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    stored = Checkpoint(folder)
    layers = {name: m for name, m in theirs.named_modules() if type(m).__name__ == "Linear4bit"}
    assert len(layers) == 14
    for name, layer in layers.items():  # transformers holds the codes and scales as saved
        assert torch.equal(layer.weight.data, stored.read(f"{name}.weight")), name
        their_state = layer.weight.quant_state.as_dict(packed=True)
        saved_state = {key: stored.read(f"{name}.weight.{key}") for key in their_state}
        assert QuantState.from_dict(their_state) == QuantState.from_dict(saved_state), name
    peer = PeerCheck()
    name = "transformers' Linear4bit forward on bitsandbytes' CPU kernels"
    peer.agrees(name, peer.runs(name, lambda: logits(theirs)), expected)
    peer.settle()


@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory):
    """A folder saved with nf4 layers, and the logits of the model saved."""
    allow = {"storage": ["keep", "nf4"], "placement": ["device"]}
    model, plan = tightfit.load(tiny_llama, 9_320_000, example_inputs=INPUTS, calibration=figures(), allow=allow)
    return tightfit.save(model, plan, tmp_path_factory.mktemp("saved") / "folder"), logits(model)


def test_a_budget_plans_placements_again_and_keeps_the_stored_storages(saved):
    folder, expected = saved
    model, plan = tightfit.load(folder, 5_000_000, example_inputs=INPUTS, calibration=figures())
    assert {e.module for e in plan.entries if e.placement == "disk"} == {"model.embed_tokens", "lm_head"}
    assert {e.storage for e in plan.entries if e.module.startswith("model.layers.")} == {"nf4"}
    assert torch.equal(logits(model), expected)


def test_a_saved_plan_for_a_device_this_machine_lacks_is_refused_unless_a_budget_plans_again(saved, tmp_path):
    folder, expected = saved
    moved = tmp_path / "moved"
    moved.mkdir()
    for file in folder.iterdir():
        (moved / file.name).write_bytes(file.read_bytes())
    plan = json.loads((moved / "tightfit-plan.json").read_text())
    plan.update(device="cuda:0", backend="cuda")
    (moved / "tightfit-plan.json").write_text(json.dumps(plan))
    if torch.cuda.is_available():
        pytest.skip("this machine has the device the plan names")
    with pytest.raises(ValueError, match=r"the plan is for cuda:0, which this machine cannot use.*pass budget"):
        tightfit.load(moved)
    model, replanned = tightfit.load(moved, 20_000_000, example_inputs=INPUTS, calibration=figures())
    assert replanned.device == "cpu" and torch.equal(logits(model), expected)


def test_loading_a_saved_folder_refuses_what_only_a_new_plan_would_use(saved, monkeypatch):
    folder, _ = saved
    with pytest.raises(ValueError, match="calibration apply only to a new plan; pass budget too"):
        tightfit.load(folder, calibration=figures())
    resolve = streaming.resolve_backend

    def with_an_accelerator(backend):  # as a machine with one resolves it
        return ResolvedBackend([], torch.device("cuda:0")) if backend == "cuda" else resolve(backend)

    monkeypatch.setattr(streaming, "resolve_backend", with_an_accelerator)
    with pytest.raises(ValueError, match=r"backend='cuda' is cuda:0, but the plan is for cpu; pass budget too"):
        tightfit.load(folder, backend="cuda")


def test_a_saved_plan_that_does_not_match_the_checkpoint_is_refused(saved, tmp_path):
    folder, _ = saved
    plan = tightfit.FitPlan.from_json((folder / "tightfit-plan.json").read_text())
    other = [replace(e, storage="fp4") if e.storage == "nf4" else e for e in plan.entries]
    with pytest.raises(
        ValueError, match=r"__nf4' stores model.layers.0.self_attn.q_proj as nf4; the plan given says fp4"
    ):
        tightfit.load(folder, plan=replace(plan, entries=tuple(other)))


def test_float8_weights_reload_only_with_their_saved_plan(tiny_llama, tmp_path):
    allow = {"storage": ["keep", "float8"], "placement": ["device"]}
    model, plan = tightfit.load(tiny_llama, 9_320_000, example_inputs=INPUTS, calibration=figures(), allow=allow)
    folder = tightfit.save(model, plan, tmp_path / "saved")
    assert Checkpoint(folder).entries["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="holds float8 weights .* leave budget out"):
        tightfit.load(folder, 20_000_000, calibration=figures())


def test_save_refuses_what_it_cannot_write_or_load_back(tiny_llama, tmp_path):
    allow = {"storage": ["keep", "nf4"], "placement": ["device"]}
    model, plan = tightfit.load(tiny_llama, 9_320_000, example_inputs=INPUTS, calibration=figures(), allow=allow)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        tightfit.save(model, plan, tmp_path / "full")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match=r"model's model.layers.0.self_attn.q_proj is a full-precision Linear.*apply"):
        tightfit.save(plain, plan, tmp_path / "a")
    with pytest.raises(TypeError, match="model must be a transformers model"):
        tightfit.save(nn.Linear(2, 2), plan, tmp_path / "b")
    with pytest.raises(ValueError, match="plan was made for LlamaForCausalLM, but model is a LlamaModel"):
        tightfit.save(transformers.AutoModel.from_pretrained(tiny_llama), plan, tmp_path / "c")
    memory_plan = replace(plan, covers_load=False)
    with pytest.raises(ValueError, match="plan does not cover loading"):
        tightfit.save(model, memory_plan, tmp_path / "d")
    with pytest.raises(ValueError, match="max_shard_size"):
        tightfit.save(model, plan, tmp_path / "e", max_shard_size="0")
    with pytest.raises(ValueError, match="source='.*' is not a folder"):
        tightfit.save(model, plan, tmp_path / "f", source=tmp_path / "missing")
    assert not any((tmp_path / name).exists() for name in "abcdef")
