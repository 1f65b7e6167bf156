"""diffusers' usage patterns with tightfit's hooks in place of diffusers' own, side by side
on tiny models built from configs (random weights, nothing downloaded)."""

from __future__ import annotations

import copy
import inspect
import logging
import re

import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers")

from diffusers.hooks.group_offloading import (  # noqa: E402
    _get_group_onload_device,
    _is_group_offload_enabled,
    _maybe_remove_and_reapply_group_offloading,
)
from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN  # noqa: E402
from diffusers.models.modeling_utils import get_parameter_dtype  # noqa: E402

from tightfit.hooks import (  # noqa: E402
    LAYERWISE_CASTING,
    OFFLOADING,
    HookRegistry,
    apply_layerwise_casting,
    apply_offloading,
    remove_layerwise_casting,
    remove_offloading,
)

F8 = torch.float8_e4m3fn

#: A tiny config for the Wan family; each class takes the keys its constructor has.
TINY_WAN = {
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "rope_max_seq_len": 32,
    "patch_size": (1, 2, 2),
    "image_dim": None,
    "vace_layers": [0],
    "vace_in_channels": 4,
}

#: diffusers models whose pins name bare parameters (``scale_shift_table``, ``history_key_scale``).
WAN_FAMILY = [
    "WanTransformer3DModel",
    "WanVACETransformer3DModel",
    "SkyReelsV2Transformer3DModel",
    "ChronoEditTransformer3DModel",
    "HeliosTransformer3DModel",
    "AnyFlowTransformer3DModel",
    "AnyFlowFARTransformer3DModel",
    "WanAnimateTransformer3DModel",
]

#: Keys a class needs beyond ``TINY_WAN`` (WanAnimate: in_channels = 2 * latent_channels + 4, a tiny motion encoder).
TINY_EXTRA = {
    "WanAnimateTransformer3DModel": {
        "in_channels": 12,
        "latent_channels": 4,
        "motion_encoder_channel_sizes": {str(2**i): 16 for i in range(2, 11)},
        "motion_encoder_size": 16,
        "motion_style_dim": 16,
        "motion_dim": 8,
        "motion_encoder_dim": 16,
        "face_encoder_hidden_dim": 16,
        "face_encoder_num_heads": 2,
        "inject_face_latents_blocks": 1,
    },
}


MODELS = {name: getattr(diffusers, name) for name in WAN_FAMILY}  # diffusers imports each lazily: once, here


def tiny(name: str) -> nn.Module:
    cls = MODELS[name]
    accepted = inspect.signature(cls.__init__).parameters
    torch.manual_seed(0)
    config = {key: value for key, value in TINY_WAN.items() if key in accepted} | TINY_EXTRA.get(name, {})
    return cls(**config).eval()


def wan_inputs() -> dict:
    generator = torch.Generator().manual_seed(1)
    return {
        "hidden_states": torch.randn(1, 4, 1, 4, 4, generator=generator),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 3, 16, generator=generator),
    }


def pins(model: nn.Module) -> tuple[str, ...]:
    return tuple(model._keep_in_fp32_modules or ()) + tuple(model._skip_layerwise_casting_patterns or ())


def float8_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.dtype == F8}


# -- layerwise casting -------------------------------------------------------------------------


@pytest.mark.parametrize("name", WAN_FAMILY)
def test_pinned_tensors_keep_their_dtype_in_the_wan_family(name, caplog):
    model = tiny(name)
    pinned = {key for key, _ in model.named_parameters() if any(re.search(p, key) for p in pins(model))}
    unpinned = copy.deepcopy(model)
    apply_layerwise_casting(unpinned, F8, torch.bfloat16, pins=False)
    assert pinned & float8_names(unpinned)  # without the pins, pinned tensors are cast: what the issue saw

    with caplog.at_level(logging.INFO, logger="tightfit.hooks"):
        apply_layerwise_casting(model, F8, torch.bfloat16)
    assert float8_names(model)  # the rest is stored in float8
    assert not pinned & float8_names(model)
    bare = [key for key in pinned if key.startswith("blocks.") and key.endswith("scale_shift_table")]
    assert bare and all(key in caplog.text for key in bare)  # kept, and said so
    remove_layerwise_casting(model)
    assert not float8_names(model)


def test_same_float8_tensors_as_enable_layerwise_casting_and_no_worse_output():
    reference = tiny("WanTransformer3DModel")
    theirs, ours = copy.deepcopy(reference), copy.deepcopy(reference)
    theirs.enable_layerwise_casting(storage_dtype=F8, compute_dtype=torch.float32)
    apply_layerwise_casting(ours, F8, torch.float32, skip=DEFAULT_SKIP_MODULES_PATTERN, scale=None)
    # diffusers casts whole layers (biases too); tightfit stores the weights, the same ones
    assert float8_names(ours) == {k for k, p in theirs.named_parameters() if p.dtype == F8 and p.dim() >= 2}
    with torch.no_grad():
        expected, by_diffusers, by_tightfit = (m(**wan_inputs()).sample for m in (reference, theirs, ours))
    assert 0 < (by_tightfit - expected).abs().max() <= (by_diffusers - expected).abs().max()


def test_get_parameter_dtype_reads_the_compute_dtype_on_the_model_and_on_submodules():
    theirs, ours = tiny("WanTransformer3DModel"), tiny("WanTransformer3DModel")
    theirs.enable_layerwise_casting(storage_dtype=F8, compute_dtype=torch.bfloat16)
    apply_layerwise_casting(ours, F8, torch.bfloat16)
    for model in (theirs, ours):
        layer = model.blocks[0].attn1.to_q
        assert layer.weight.dtype == F8
        assert model.dtype == get_parameter_dtype(model.blocks[0]) == get_parameter_dtype(layer) == torch.bfloat16
    assert ours.blocks[0].attn1.to_q._diffusers_hook.get_hook("layerwise_casting").compute_dtype == torch.bfloat16
    remove_layerwise_casting(ours)
    assert ours.dtype == get_parameter_dtype(ours.blocks[0].attn1.to_q) == torch.float32
    assert not any("_diffusers_hook" in m.__dict__ or "forward" in m.__dict__ for m in ours.modules())


def minimax_h3_autoencoder() -> nn.Module:
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLMiniMaxH3(
        latent_channels=4,
        block_out_channels=(8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 1),
        temporal_downsample_factors=(1, 1),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=2,
        clip_length=1,
        token_drop=0,
        latents_mean=(0.0,) * 4,
        latents_std=(1.0,) * 4,
    ).eval()
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.1)  # its scales start at zero: the blocks would add nothing
    return model.to(torch.bfloat16)


def test_minimax_h3_autoencoder_casts_its_activations_to_the_compute_dtype():
    """Its decoder blocks cast activations to ``get_parameter_dtype(self.attn.to_q)``: float8 before."""
    reference = minimax_h3_autoencoder()
    theirs, ours = copy.deepcopy(reference), copy.deepcopy(reference)
    theirs.enable_layerwise_casting(storage_dtype=F8, compute_dtype=torch.bfloat16)
    apply_layerwise_casting(ours, F8, torch.bfloat16)
    block = ours.decoder.transformer_blocks[0]
    assert block.attn.to_q.weight.dtype == F8 and get_parameter_dtype(block.attn.to_q) == torch.bfloat16
    assert HookRegistry.get(block) is None  # its own tensors are the pinned scale1 and scale2: no hook
    latents = torch.randn(1, 4, 1, 4, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        expected, by_diffusers, by_tightfit = (m.decode(latents).sample.float() for m in (reference, theirs, ours))
    assert by_tightfit.isfinite().all()
    assert (by_tightfit - expected).abs().max() <= 2 * (by_diffusers - expected).abs().max()


def test_equal_storage_and_compute_dtypes_are_a_no_op():
    model = tiny("WanTransformer3DModel").to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_layerwise_casting(model, torch.bfloat16, torch.bfloat16) == []
    assert apply_layerwise_casting(model, torch.float32, torch.float32) == []
    assert not any(HookRegistry.get(m) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_without_diffusers_modules_gets_no_diffusers_registry():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    apply_layerwise_casting(model, F8, torch.float32)
    apply_offloading(model, "cpu")
    assert not any("_diffusers_hook" in m.__dict__ for m in model.modules())
    assert model[0].__dict__["forward"].func.__name__ == "_hooked_forward"


# -- offloading ---------------------------------------------------------------------------------


def test_group_offloading_guards_see_tightfit_offloading():
    ours, theirs = tiny("WanTransformer3DModel"), tiny("WanTransformer3DModel")
    apply_offloading(ours, "cpu")
    theirs.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    for model in (ours, theirs):
        assert _is_group_offload_enabled(model)
        assert _get_group_onload_device(model) == model.device == torch.device("cpu")
        assert model.to("meta") is model  # ModelMixin.to refuses to move an offloaded model
        assert model.blocks[0].attn1.to_q.weight.device.type == "cpu"
    config = ours.blocks[0]._diffusers_hook.get_hook("group_offloading").config
    assert (config.onload_device, config.offload_device, config.use_stream) == (torch.device("cpu"),) * 2 + (False,)
    remove_offloading(ours)
    assert not _is_group_offload_enabled(ours)


def test_blocks_per_unit_like_num_blocks_per_group():
    reference = tiny("WanTransformer3DModel")
    ours, theirs = copy.deepcopy(reference), copy.deepcopy(reference)
    units = apply_offloading(ours, "cpu", blocks_per_unit=2)
    theirs.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=2)
    assert "blocks.0+blocks.1" in units
    hook = HookRegistry.get(ours.blocks[0]).hook(OFFLOADING)
    assert HookRegistry.get(ours.blocks[1]).hook(OFFLOADING) is hook and hook.members == list(ours.blocks)
    assert hook.diffusers_config().num_blocks_per_group == 2
    held = []  # whether the unit's copies are in after each block's forward (a torch hook runs after ours)
    for block in ours.blocks:
        block.register_forward_hook(lambda *_: held.append(hook._stored is not None))
    with torch.no_grad():
        expected, by_diffusers, by_tightfit = (m(**wan_inputs()).sample for m in (reference, theirs, ours))
    assert held == [True, False]  # brought in by the first block, dropped after the last
    assert torch.equal(by_tightfit, expected) and torch.equal(by_diffusers, expected)


def test_skip_leaves_modules_and_bare_tensors_where_they_are():
    model = tiny("WanTransformer3DModel")
    units = apply_offloading(model, "cpu", granularity="leaf", skip=("proj_out", "scale_shift_table"))
    assert "proj_out" not in units and HookRegistry.get(model.proj_out) is None
    state = HookRegistry.get(model.blocks[0].attn1.to_q).hook(OFFLOADING).state
    offloaded = {id(record.tensor) for record in state.records.values()}
    assert id(model.blocks[0].scale_shift_table) not in offloaded
    assert id(model.blocks[0].attn1.to_q.weight) in offloaded
    remove_offloading(model)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"use_stream": True}, ValueError, "use_stream=True needs a device whose backend copies asynchronously"),
        ({"use_stream": "yes"}, TypeError, "use_stream must be bool"),
        ({"blocks_per_unit": 0}, ValueError, "blocks_per_unit must be an int >= 1, got 0"),
        ({"blocks_per_unit": 2, "granularity": "leaf"}, ValueError, "groups the blocks of granularity='block'"),
        ({"offload_to": "tape"}, ValueError, "offload_to='tape' is not accepted; accepted: 'cpu', 'disk' or a device"),
        ({"offload_to": 1}, TypeError, "offload_to must be a str or torch.device"),
        ({"offload_to": "meta"}, ValueError, "backend 'meta' is not known"),
        ({"skip": 3}, TypeError, "skip must be a str or a tuple of str"),
    ],
)
def test_offloading_arguments(kwargs, error, match):
    model = tiny("WanTransformer3DModel")
    with pytest.raises(error, match=match):
        apply_offloading(model, "cpu", **kwargs)
    assert not any(HookRegistry.get(m) for m in model.modules())


def test_use_stream_is_refused_on_the_cpu_by_both():
    with pytest.raises(ValueError, match="use_stream"):
        tiny("WanTransformer3DModel").enable_group_offload(torch.device("cpu"), num_blocks_per_group=1, use_stream=True)
    with pytest.raises(ValueError, match="use_stream=True needs a device whose backend copies asynchronously"):
        apply_offloading(tiny("WanTransformer3DModel"), "cpu", use_stream=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_an_offload_device_that_is_not_here_is_refused():
    with pytest.raises(RuntimeError, match="not available on this machine"):
        apply_offloading(tiny("WanTransformer3DModel"), "cpu", offload_to="cuda:1")


def test_offload_to_a_device_object_and_a_meta_skeleton():
    model = tiny("WanTransformer3DModel")
    apply_offloading(model, torch.device("cpu"), offload_to=torch.device("cpu"))
    assert HookRegistry.get(model.blocks[0]).hook(OFFLOADING).state.offload_to == "cpu"
    remove_offloading(model)
    with torch.device("meta"):
        skeleton = tiny("WanTransformer3DModel")
    with pytest.raises(ValueError, match="is on the meta device"):
        apply_offloading(skeleton, "cpu")


def test_diffusers_cannot_remove_tightfit_offloading_behind_its_back():
    """Loading a LoRA re-applies diffusers' group offloading; on tightfit's it says what to do instead."""
    model = tiny("WanTransformer3DModel")
    apply_offloading(model, "cpu")
    with pytest.raises(RuntimeError, match="tightfit.hooks.remove_offloading"):
        _maybe_remove_and_reapply_group_offloading(model)
    with torch.no_grad():
        model(**wan_inputs())  # still runs
    remove_offloading(model)
    assert not any("_diffusers_hook" in m.__dict__ for m in model.modules())


def test_diffusers_group_offloading_composes_with_tightfit_casting():
    reference, model = tiny("WanTransformer3DModel"), tiny("WanTransformer3DModel")
    for m in (reference, model):
        apply_layerwise_casting(m, F8, torch.float32)
    model.enable_group_offload(torch.device("cpu"), offload_type="leaf_level")
    with torch.no_grad():
        assert torch.equal(model(**wan_inputs()).sample, reference(**wan_inputs()).sample)


def test_tightfit_casting_then_offloading_on_a_diffusers_model():
    reference, model = tiny("WanTransformer3DModel"), tiny("WanTransformer3DModel")
    for m in (reference, model):
        apply_layerwise_casting(m, F8, torch.float32)
    apply_offloading(model, "cpu", blocks_per_unit=2)
    assert model.blocks[0]._diffusers_hook.get_hook("group_offloading") is not None
    assert model.blocks[0].attn1.to_q._diffusers_hook.get_hook("layerwise_casting") is not None
    with torch.no_grad():
        assert torch.equal(model(**wan_inputs()).sample, reference(**wan_inputs()).sample)
    remove_offloading(model)
    remove_layerwise_casting(model)
    assert not any(
        "_diffusers_hook" in m.__dict__ or LAYERWISE_CASTING in (HookRegistry.get(m) or ()) for m in model.modules()
    )


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_unit_of_blocks_brings_its_copies_in_once_and_drops_them_after_the_last(monkeypatch):
    """The swap itself, seen on the CPU: the unit's copies stand in for its tensors from the
    first block's forward to the end of the last one's (a device would make them on-device copies)."""
    model = Blocks()
    assert apply_offloading(model, "cpu", blocks_per_unit=2) == ["blocks.0+blocks.1", "blocks.2"]
    hook = HookRegistry.get(model.blocks[0]).hook(OFFLOADING)
    stored = [slot.get() for slot in hook.slots]
    loads = []
    monkeypatch.setattr(hook, "moves", True)
    monkeypatch.setattr(hook, "_onload", lambda: loads.append(1) or [t.detach().clone() for t in stored])
    in_place = []  # after each block of the unit: whether its slots hold the stored tensors
    for block in model.blocks[:2]:
        block.register_forward_hook(lambda *_: in_place.append(all(s.get() is t for s, t in zip(hook.slots, stored))))
    x = torch.randn(1, 4)
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(model(x), expected)
    assert loads == [1, 1]  # once a pass, by the first block
    assert in_place == [False, True] * 2  # copies in after block 0; stored tensors back after block 1
    remove_offloading(model)
