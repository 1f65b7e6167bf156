"""``bfloat16`` storage: a wider weight stored in bfloat16 and upcast to its own dtype for
each forward (layerwise casting, no scale); a weight of 2 bytes or fewer stays as it is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit
from tightfit.hooks.casting import LAYERWISE_CASTING
from tightfit.hooks.registry import HookRegistry
from tightfit.memory import allocated_peak
from tightfit.quant import storage_format, storage_formats
from zoo.lm import figures

BF16 = storage_format("bfloat16")


class Reads(nn.Module):
    """A model whose ``dtype`` property reads its first parameter, as transformers' and
    diffusers' models do: its embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(ids))))


def reads(dtype: torch.dtype = torch.float32) -> Reads:
    torch.manual_seed(0)
    return Reads().to(dtype).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(1))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).pow(2).mean() / want.float().pow(2).mean()).sqrt().item()


def test_its_place_rank_and_kind():
    names = [storage.name for storage in storage_formats()]
    assert names.index("bfloat16") == names.index("keep") + 1
    assert BF16.rank == 1 and BF16.casts and BF16.decodes
    assert BF16.leaf_types == (nn.Linear, nn.Embedding) and BF16.config is None
    assert all(storage.rank > BF16.rank for storage in storage_formats() if storage.name not in ("keep", "bfloat16"))


def test_its_bytes_save_only_on_weights_wider_than_2_bytes():
    shape, numel = (256, 512), 256 * 512
    assert BF16.stored_bytes(shape, torch.float32) == numel * 2
    assert BF16.transient_bytes(shape, 8, 0, torch.float32) == numel * 4  # the upcast copy
    assert BF16.convert_bytes(shape, torch.float32) == numel * 5  # the finite check's copy and masks, less the result
    assert BF16.held_offloaded(shape, torch.float32) == 0
    for dtype in (torch.bfloat16, torch.float16):
        assert BF16.stored_bytes(shape, dtype) == numel * 2 == storage_format("keep").stored_bytes(shape, dtype)
        assert BF16.transient_bytes(shape, 8, 0, dtype) == 0
        assert BF16.convert_bytes(shape, dtype) == 0


def test_applied_weights_are_stored_in_bfloat16_and_compute_in_float32():
    model = reads()
    x = ids()
    with torch.no_grad():
        want = model(x)
    BF16.apply(model, frozenset({"up", "down"}))
    assert model.up.weight.dtype == model.down.weight.dtype == torch.bfloat16
    assert model.up.bias.dtype == model.embed.weight.dtype == model.dtype == torch.float32
    with torch.no_grad():
        got = model(x)
    assert got.dtype == torch.float32
    assert relative_error(got, want) < 0.01
    assert model.up.weight.dtype == torch.bfloat16  # stored again after the forward


def test_an_embedding_is_stored_too():
    model = nn.Sequential(nn.Embedding(100, 64)).eval()
    x = ids()
    want = model(x)
    BF16.apply(model, frozenset({"0"}))
    assert model[0].weight.dtype == torch.bfloat16
    got = model(x)
    assert got.dtype == torch.float32 and relative_error(got, want) < 0.01


def test_the_weight_model_dtype_reads_is_refused():
    model = reads()
    with pytest.raises(ValueError, match="embed.weight is what model.dtype reads; bfloat16 storage would change"):
        BF16.apply(model, frozenset({"embed", "up"}))
    assert model.up.weight.dtype == torch.float32  # refused before anything is cast


def test_applied_twice_is_refused():
    model = reads()
    BF16.apply(model, frozenset({"up"}))
    with pytest.raises(ValueError, match="layerwise casting is already applied"):
        BF16.apply(model, frozenset({"up"}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_2_byte_weight_stays_as_it_is(dtype):
    model = reads(dtype)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    x = ids()
    want = model(x)
    BF16.apply(model, frozenset({"up", "down"}))
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == dtype and torch.equal(tensor, before[name]), name
    assert HookRegistry.get(model.up) is None or LAYERWISE_CASTING not in HookRegistry.get(model.up)
    assert torch.equal(model(x), want)


def test_a_forward_allocates_at_most_its_transient_bytes():
    layer = nn.Sequential(nn.Linear(256, 512, bias=False)).eval()
    BF16.apply(layer, frozenset({"0"}))
    x = torch.randn(8, 256)
    with torch.inference_mode():
        layer(x)
        peak = allocated_peak(lambda: layer(x))
    output = 8 * 512 * 4
    declared = BF16.transient_bytes((512, 256), 8, 0, torch.float32)
    assert declared - 16 * 1024 <= peak - output <= declared + 16 * 1024


def test_its_decode_probe_is_the_upcast():
    linear = nn.Linear(64, 32)
    work, baseline = BF16.decode_probe(linear, torch.randn(4, 64))
    assert baseline is None
    upcast = work()
    assert upcast.dtype == torch.float32 and upcast.shape == linear.weight.shape
    assert torch.equal(upcast, linear.weight.detach().to(torch.bfloat16).float())


def four_linears(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4))).to(dtype).eval()


def test_the_planner_takes_it_before_float8_for_a_float32_model():
    model = four_linears(torch.float32)
    x = torch.randn(8, 256)
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures()).full_peak_bytes
    # 128 KiB saved a layer in bfloat16, less one layer's upcast copy (256 KiB) while it computes
    plan = tightfit.fit(model, (x,), full - 200 * 1024, calibration=figures())
    chosen = [entry.storage for entry in plan.entries]
    assert chosen == ["bfloat16"] * 4, chosen
    want = model(x)
    plan.apply(model)
    assert all(linear.weight.dtype == torch.bfloat16 for linear in model)
    assert relative_error(model(x), want) < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_planner_never_takes_it_for_a_2_byte_model(dtype):
    model = four_linears(dtype)
    x = torch.randn(8, 256, dtype=dtype)
    full = tightfit.fit(model, (x,), "1GiB", calibration=figures()).full_peak_bytes
    plan = tightfit.fit(model, (x,), full - 100 * 1024, calibration=figures())
    assert "bfloat16" not in {entry.storage for entry in plan.entries}
    assert any(entry.storage != "keep" or entry.placement != "device" for entry in plan.entries)


def test_its_noise_is_a_fraction_of_float8s():
    assert BF16.noise < storage_format("float8").noise / 10  # each measured by test_catalogue_noise.py
