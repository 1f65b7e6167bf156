"""Tied weights are one unit of the plan: GPT-2's wte and lm_head, a Gemma LM's embedding
and head. The planner may move such a unit off the device (it keeps its dtype), weighs
both uses of the shared weight, and FitPlan.apply and tightfit.load carry the plan out
with the weight stored once."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import tightfit
from tightfit.fitting import FitPlan, PlanEntry, held_bytes
from tightfit.fitting.execute import offload_units
from tightfit.fitting.options import PLACEMENTS, TIED_DECODE, find_units, options_for, storage_names
from tightfit.hooks import OFFLOADING, apply_layerwise_casting
from tightfit.hooks.registry import HookRegistry
from tightfit.loading import Checkpoint, plan_folder
from tightfit.loading import stream as streaming
from tightfit.memory import LiveTensorBytes
from zoo.lm import figures, tiny_lm, token_ids

transformers = pytest.importorskip("transformers")

IDS = torch.arange(3, 19).unsqueeze(0)  # 16 tokens: the weights, not the logits, dominate the peak
KEEP = {"storage": ["keep"]}  # lossless: the outputs stay equal
FLOAT8 = {"storage": ["keep", "float8"]}  # lossy where it is chosen (not on the tied unit: it keeps its dtype)


def gpt2() -> torch.nn.Module:
    """GPT-2 with Conv1D layers; wte (2000 x 64) is 55% of its weights."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=2000, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def gemma() -> torch.nn.Module:
    """A Gemma LM with tie_word_embeddings: its embedding is a scaled nn.Embedding subclass."""
    config = transformers.GemmaConfig(
        vocab_size=2000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "gemma": gemma}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    path = tmp_path_factory.mktemp(type(model).__name__)
    model.save_pretrained(path)
    return path


def _embedding_name(model) -> str:
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding)


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def _offloaded(model) -> set[str]:
    return {name for name, module in model.named_modules() if (r := HookRegistry.get(module)) and OFFLOADING in r}


def _check_tied(model, plan: FitPlan) -> PlanEntry:
    """The tied entry: first, off the device, kept as it is; both modules hooked, one weight."""
    entry = plan.entries[0]
    assert entry.modules == (_embedding_name(model), "lm_head")
    assert entry.storage == "keep" and entry.placement == "disk"
    assert set(entry.modules) <= _offloaded(model)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return entry


def test_tied_modules_are_one_unit_named_after_the_first(model):
    units = find_units(model)
    tied = units[0]
    embedding = model.get_input_embeddings()
    assert tied.name == _embedding_name(model) and tied.kind == "embedding" and not tied.fixed
    assert "lm_head" in [name for name, *_ in tied.weights]
    assert not any("lm_head" in [name for name, *_ in unit.weights] for unit in units[1:])
    assert tied.no_decode == TIED_DECODE  # Gemma's scaled embedding is no leaf, yet holds the head's weight
    every_option = options_for(
        tied,
        storages=frozenset(storage_names()),
        placements=frozenset(PLACEMENTS),
        device=torch.device("cpu"),
        rows={},
        live={},
        figures=figures(),
    )
    assert {o.storage for o in every_option} == {"keep"} and {o.placement for o in every_option} == {"device", "disk"}
    distinct = {id(t): t for t in [*embedding.parameters(), *embedding.buffers(), *model.lm_head.parameters()]}
    assert tied.bytes == sum(t.numel() * t.element_size() for t in distinct.values())  # the shared weight once
    full = tightfit.fit(model, {"input_ids": IDS}, "1GiB", calibration=figures())
    every = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    assert full.predicted_weights_bytes == sum(t.numel() * t.element_size() for t in every.values())


@pytest.mark.parametrize("loading", [False, True])
@pytest.mark.parametrize("allow", [KEEP, FLOAT8], ids=["keep", "float8"])
def test_a_plan_at_40_percent_applies_and_keeps_the_outputs(model, loading, allow):
    full = tightfit.fit(model, {"input_ids": IDS}, "1GiB", calibration=figures(), loading=loading).full_peak_bytes
    budget = int(full * 0.4)
    plan = tightfit.fit(model, {"input_ids": IDS}, budget, calibration=figures(), loading=loading, allow=allow)
    assert plan.predicted_peak_bytes <= budget and not plan.applies_nothing
    applied = plan.apply(copy.deepcopy(model))
    _check_tied(applied, plan)
    assert held_bytes(applied, "cpu") == plan.predicted_weights_bytes
    reference, logits = _logits(model), _logits(applied)
    if all(e.storage == "keep" for e in plan.entries):
        assert torch.equal(logits, reference)
    else:
        assert torch.allclose(logits, reference, rtol=0, atol=0.05 * reference.abs().max().item())


@pytest.mark.parametrize("allow", [KEEP, FLOAT8], ids=["keep", "float8"])
def test_load_streams_a_tied_unit_in_place_within_its_predicted_peak(model, folder, allow):
    _, full = plan_folder(folder, "1GiB", example_inputs={"input_ids": IDS}, calibration=figures())
    budget = int(full.full_peak_bytes * 0.4)
    skeleton, plan = plan_folder(folder, budget, example_inputs={"input_ids": IDS}, calibration=figures(), allow=allow)
    with LiveTensorBytes("cpu") as tracker:
        streaming.stream(skeleton, Checkpoint(folder), plan, torch.device("cpu"))
    assert tracker.peak <= plan.predicted_load_peak_bytes <= plan.predicted_peak_bytes <= budget
    entry = _check_tied(skeleton, plan)
    stored = set(Checkpoint(folder).entries)
    unmapped = sum(  # buffers the checkpoint lacks (Gemma's embed_scale) stay in memory beside the mapped weight
        buffer.nbytes
        for name in entry.modules
        for key, buffer in skeleton.get_submodule(name).named_buffers()
        if f"{name}.{key}" not in stored
    )
    assert held_bytes(skeleton, "cpu") == plan.predicted_weights_bytes + unmapped
    reference = plan.apply(copy.deepcopy(model))
    assert torch.equal(_logits(skeleton), _logits(reference))  # bit for bit as the plan applied in memory
    loaded, again = tightfit.load(folder, plan=plan)
    assert again is plan and torch.equal(_logits(loaded), _logits(reference))


def test_options_weigh_both_uses_of_the_shared_weight():
    model = tiny_lm(vocab=64)  # embed (64 x 128), head Linear(128 -> 64)
    model.head.weight = model.embed.weight
    (unit,) = [u for u in find_units(model) if u.name == "embed"]
    assert [name for name, *_ in unit.weights] == ["embed", "head"] and unit.tied == ("head",)
    size, bias = 64 * 128 * 4, 64 * 4
    rows = {"embed": 8, "head": 8}
    fast = figures(host_to_device_bandwidth=1e9)
    found = {
        (o.storage, o.placement): o
        for o in options_for(
            unit,
            storages=frozenset({"keep", "float8", "nf4"}),
            placements=frozenset({"device", "cpu", "disk"}),
            device=torch.device("cuda"),  # only its type counts: an accelerator, which copies per use
            rows=rows,
            live={},
            figures=fast,
        )
    }
    assert set(found) == {("keep", "device"), ("keep", "cpu"), ("keep", "disk")}  # tied: it keeps its dtype
    matmul = 2 * size / 4 * rows["head"] / fast.matmul_flops
    # the head reads every row; the embedding the pages its 8 rows touch (here all 8)
    touched = bias + size + min(size, rows["embed"] * 4096)
    kept = found["keep", "device"]
    assert kept.stored_bytes == kept.held_bytes == size + bias  # stored once
    assert math.isclose(kept.seconds, matmul + touched / fast.device_bandwidth)
    on_cpu = found["keep", "cpu"]
    assert on_cpu.held_bytes == 0 and on_cpu.onload_bytes == size + bias  # one copy at a time
    copies = (size + bias + size) / fast.host_to_device_bandwidth  # each leaf's forward copies the weight in
    assert math.isclose(on_cpu.seconds, kept.seconds + copies)
    assert math.isclose(found["keep", "disk"].seconds, on_cpu.seconds + (size + bias + size) / fast.disk_bandwidth)


def test_a_tied_entry_keeps_its_dtype():
    with pytest.raises(ValueError, match="tied weights .*accepted: 'keep'"):
        PlanEntry("embed", "embedding", "float8", "device", 1, 1, 1, 0.0, "", leaves=("embed", "head"))


def test_a_tied_plan_applies_on_a_plain_module_and_round_trips_json():
    model = tiny_lm(vocab=64)
    model.head.weight = model.embed.weight
    ids = token_ids(vocab=64)
    reference = model(ids)
    plan = tightfit.fit(model, (ids,), "1GiB", calibration=figures())
    tied = dataclasses.replace(plan.entries[0], placement="disk", held_bytes=0)
    plan = dataclasses.replace(plan, applies_nothing=False, entries=(tied, *plan.entries[1:]))
    assert FitPlan.from_json(plan.to_json()) == plan
    assert tied.leaves == ("embed", "head") and tied.modules == ("embed", "head")
    plan.apply(model)
    assert _offloaded(model) == {"embed", "head"} and model.head.weight is model.embed.weight
    assert torch.equal(model(ids), reference)


def test_offload_units_gives_tied_modules_one_stored_copy():
    model = tiny_lm(vocab=64)
    model.head.weight = model.embed.weight
    ids = token_ids(vocab=64)
    reference = model(ids)
    entry = PlanEntry("embed", "embedding", "keep", "disk", 1, 1, 0, 0.0, "", leaves=("embed", "head"))
    offload_units(model, [entry], torch.device("cpu"))
    assert _offloaded(model) == {"embed", "head"}
    hooks = [HookRegistry.get(m).hook(OFFLOADING) for m in (model.embed, model.head)]
    state = hooks[0].state
    assert hooks[1].state is state and len(state.records) == 2  # the shared weight once, the head's bias
    weight_file = state.records[id(model.embed.weight)].file
    assert weight_file in hooks[0].files and weight_file in hooks[1].files  # both read the one copy
    assert torch.equal(model(ids), reference)


def test_a_tensor_shared_with_a_layer_stays_fixed():
    model = tiny_lm(vocab=512)  # embed (512 x 128), like layers.0.up's weight
    model.embed.weight = model.layers[0].up.weight
    fixed = {u.name: u.fixed for u in find_units(model) if u.fixed and u.kind != "rest"}
    assert set(fixed) == {"embed", "layers.0"} and all("tied" in why for why in fixed.values())


def test_one_casting_call_over_tied_modules_shares_one_stored_copy():
    """Why compact storage of a tied unit needs one casting call over both modules: the
    catalogue's float8 casts leaf by leaf, and the second leaf meets a float8 weight."""
    model = tiny_lm(vocab=64)
    model.head.weight = model.embed.weight
    ids = token_ids(vocab=64)
    reference = model(ids)
    hooked = apply_layerwise_casting(
        model, torch.float8_e4m3fn, torch.float32, granularity=lambda name, _: name in ("embed", "head"), skip=()
    )
    assert hooked == ["embed", "head"] and model.head.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(model.embed.weight_scale, model.head.weight_scale)
    assert torch.allclose(model(ids), reference, rtol=0, atol=0.05 * reference.abs().max().item())


class _TwoTied(torch.nn.Module):
    """Two embeddings, each tied to a head of its own: two units of tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.e1, self.e2 = torch.nn.Embedding(64, 16), torch.nn.Embedding(64, 16)
        self.h1, self.h2 = torch.nn.Linear(16, 64, bias=False), torch.nn.Linear(16, 64, bias=False)
        self.h1.weight, self.h2.weight = self.e1.weight, self.e2.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.h1(self.e1(ids)) + self.h2(self.e2(ids))


def test_two_tied_units_off_the_device_are_offloaded_together():
    # one call over their common parent (the model) for both: a second call would find it hooked
    torch.manual_seed(0)
    model, ids = _TwoTied().eval(), token_ids(vocab=64)
    reference = model(ids)
    plan = tightfit.fit(model, ids, 1 << 30, calibration=figures())
    tied = [e for e in plan.entries if len(e.modules) > 1]
    assert [e.modules for e in tied] == [("e1", "h1"), ("e2", "h2")]
    moved = tuple(dataclasses.replace(e, placement="disk") if len(e.modules) > 1 else e for e in plan.entries)
    dataclasses.replace(plan, entries=moved, applies_nothing=False).apply(model)
    assert _offloaded(model) == {"e1", "h1", "e2", "h2"}
    assert torch.equal(model(ids), reference)
