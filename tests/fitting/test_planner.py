"""The planner's decisions on small models with injected figures, where the answer is known."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tightfit
from tightfit.fitting import Allow, FitError
from tightfit.fitting.options import Unit, find_units, options_for
from tightfit.fitting.search import peak_of, search
from zoo.lm import figures, tiny_lm, token_ids


def four_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(4))).eval()


X = torch.randn(8, 256)
KEEP_8BIT = {"storage": {"keep", "8bit"}, "placement": {"device"}}
BYTES_8BIT = 256 * 256 + 4 * 16 + 1024  # codes, one scale per 4096, the 256-entry map


def test_budget_above_needs_applies_nothing():
    model = four_linears()
    plan = tightfit.fit(model, (X,), "1GiB", calibration=figures())
    assert plan.applies_nothing
    assert all(e.storage == "keep" and e.placement == "device" for e in plan.entries)
    assert plan.predicted_peak_bytes == plan.full_peak_bytes == 4 * 256 * 256 * 4 + plan.predicted_activation_bytes
    assert plan.predicted_transient_bytes == 0
    assert "changes nothing" in str(plan)
    assert plan.apply(model) is model
    assert all(type(m) is nn.Linear for m in model)


def test_just_enough_layers_are_converted():
    # each conversion saves 256 KiB - 8-bit bytes; the decoded copy (256 KiB) is alive while one computes
    model = four_linears()
    full = tightfit.fit(model, (X,), "1GiB", calibration=figures()).full_peak_bytes
    budget = full - 300 * 1024  # three conversions are needed: 2 save 2 * 190 KiB < 300 KiB + 256 KiB
    plan = tightfit.fit(model, (X,), budget, allow=KEEP_8BIT, calibration=figures())
    assert [e.storage for e in plan.entries].count("8bit") == 3
    assert plan.predicted_weights_bytes == 3 * BYTES_8BIT + 256 * 256 * 4
    assert (
        256 * 256 * 4 <= plan.predicted_transient_bytes <= 256 * 256 * 4 + 16 * 1024
    )  # the copy, and what is alive then
    assert plan.predicted_peak_bytes <= budget
    assert not plan.applies_nothing


def test_more_bits_kept_when_they_fit():
    # decoding is free, so 8-bit and NF4 cost the same time: the planner keeps 8 bits
    model = four_linears()
    allow = {"storage": {"keep", "8bit", "nf4"}}
    plan = tightfit.fit(model, (X,), "900KiB", allow=allow, calibration=figures(), max_error=1.0)
    assert {e.storage for e in plan.entries} <= {"keep", "8bit"}
    tight = tightfit.fit(model, (X,), "450KiB", allow=allow, calibration=figures(), max_error=1.0)
    assert "nf4" in {e.storage for e in tight.entries}


def test_a_less_precise_storage_is_not_chosen_for_speed():
    # fp4 decodes faster than nf4 here; it saves no memory over nf4, so nf4 stays
    fast_fp4 = figures(decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 0, "nf4": 1e-9, "fp4": 0})
    allow = {"storage": {"keep", "nf4", "fp4"}}
    plan = tightfit.fit(four_linears(), (X,), "450KiB", allow=allow, calibration=fast_fp4, max_error=1.0)
    assert "nf4" in {e.storage for e in plan.entries} and "fp4" not in {e.storage for e in plan.entries}


def test_time_model_decides_between_disk_and_quantization():
    model = four_linears()
    allow = {"storage": {"keep", "nf4"}, "placement": {"device", "disk"}}
    slow_decode = figures(
        decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 0, "nf4": 1e-6, "fp4": 0}, disk_bandwidth=1e12
    )
    plan = tightfit.fit(model, (X,), "400KiB", allow=allow, calibration=slow_decode)
    assert {e.storage for e in plan.entries} == {"keep"} and [e.placement for e in plan.entries].count("disk") == 3
    slow_disk = figures(
        decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 0, "nf4": 1e-12, "fp4": 0}, disk_bandwidth=1e3
    )
    plan = tightfit.fit(model, (X,), "600KiB", allow=allow, calibration=slow_disk, max_error=1.0)
    assert {e.placement for e in plan.entries} == {"device"} and "nf4" in {e.storage for e in plan.entries}


def test_disk_weights_are_not_held_on_the_cpu():
    model = four_linears()
    plan = tightfit.fit(
        model, (X,), 200 * 1024, allow={"storage": {"keep"}, "placement": {"device", "disk"}}, calibration=figures()
    )
    assert all(e.placement == "disk" and e.held_bytes == 0 for e in plan.entries)
    assert plan.predicted_weights_bytes == 0


def test_units_follow_the_layer_stack():
    model = tiny_lm()
    plan = tightfit.fit(model, {"input_ids": token_ids()}, "1GiB", calibration=figures())
    names = [e.module for e in plan.entries]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    assert plan.entries[1].leaves == ("layers.0.up", "layers.0.down")
    assert plan.entries[1].bytes_before == sum(t.numel() * 4 for t in model.layers[0].state_dict().values())


def test_keyword_and_positional_inputs_plan_alike():
    model = tiny_lm()
    ids = token_ids()
    by_keyword = tightfit.fit(model, {"input_ids": ids}, "1GiB", calibration=figures())
    by_position = tightfit.fit(model, (ids,), "1GiB", calibration=figures())
    assert by_keyword.predicted_peak_bytes == by_position.predicted_peak_bytes


class MatmulBlock(nn.Module):
    """A layer without nn.Linear (as GPT-2's Conv1D layers): it can move, not be quantized."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(128, 128) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_stack_without_linear_layers_is_offloaded_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList(MatmulBlock() for _ in range(4)))
    model.forward = lambda x: [x := block(x) for block in model[0]][-1]
    x = torch.randn(4, 128)
    plan = tightfit.fit(model, (x,), 150 * 1024, calibration=figures())
    assert [e.module for e in plan.entries] == ["0.0", "0.1", "0.2", "0.3"]
    assert {e.storage for e in plan.entries} == {"keep"} and "disk" in {e.placement for e in plan.entries}


@pytest.mark.parametrize(
    "allow",
    [
        {"storage": {"keep", "float8"}, "placement": {"device", "disk"}},
        {"storage": {"keep", "int8"}},
        {"placement": {"device", "disk"}, "storage": {"keep"}},
        Allow(storage=frozenset({"keep", "fp4", "float8"})),
    ],
)
def test_allow_is_respected(allow):
    model = tiny_lm()
    ids = token_ids()
    full = tightfit.fit(model, (ids,), "1GiB", calibration=figures()).full_peak_bytes
    for fraction in (0.6, 0.3):
        try:
            plan = tightfit.fit(model, (ids,), int(full * fraction), allow=allow, calibration=figures())
        except FitError:
            continue
        rules = Allow.coerce(allow)
        assert all(e.storage in rules.storage and e.placement in rules.placement for e in plan.entries)
        assert plan.allow == rules.to_dict()


def test_no_fit_names_the_smallest_peak_and_the_weights_that_dominate():
    model = four_linears()
    with pytest.raises(FitError) as caught:
        tightfit.fit(
            model, (X,), "500KiB", allow={"storage": {"keep", "8bit"}, "placement": {"device"}}, calibration=figures()
        )
    error = caught.value
    activations = tightfit.fit(model, (X,), "1GiB", calibration=figures()).predicted_activation_bytes
    assert (
        4 * BYTES_8BIT + 256 * 256 * 4
        <= error.smallest_peak_bytes - activations
        <= 4 * BYTES_8BIT + 256 * 256 * 4 + 16 * 1024
    )
    assert error.budget_bytes == 500 * 1024
    assert "smallest predicted peak" in str(error) and f"({error.smallest_peak_bytes} B)" in str(error)
    assert "decoded weights while their unit computes" in error.parts[0][0]
    assert "weights of 0 (8bit on the device)" in str(error)


def test_no_fit_names_the_activation_peak():
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    with pytest.raises(FitError, match=r"dominated by activations and inputs \(peak at node \w+\).*slice by slice"):
        tightfit.fit(model, (torch.randn(100_000, 8),), "1MB", calibration=figures())


def test_offloaded_units_count_two_onloaded_copies_on_an_accelerator():
    # options and search alone: no accelerator is touched
    unit = Unit("a", "linear", (("a", "Linear", (256, 256), torch.float32),), 256 * 256 * 4, 0)
    figs = figures(host_to_device_bandwidth=1e10)
    options = options_for(
        unit,
        storages=frozenset({"keep"}),
        placements=frozenset({"device", "cpu"}),
        device=torch.device("cuda"),
        rows={"a": 8},
        live={},
        figures=figs,
    )
    assert [(o.placement, o.held_bytes, o.onload_bytes) for o in options] == [("device", 262144, 0), ("cpu", 0, 262144)]
    # four kept do not fit, nor 3 kept + 1 copy, nor 2 + 2 copies (prefetch); 1 kept + 2 copies does
    found = search([options] * 4, 4 * 262144 - 1, 0)
    assert found.best is not None
    assert found.best.onload_bytes == 2 * 262144 and found.best.held_bytes == 262144


def test_cpu_placement_is_not_offered_on_the_cpu():
    model = four_linears()
    plan = tightfit.fit(
        model,
        (X,),
        200 * 1024,
        allow={"storage": {"keep"}, "placement": {"device", "cpu", "disk"}},
        calibration=figures(),
    )
    assert {e.placement for e in plan.entries} == {"disk"}


def _float8_and_int8(int8_share: float) -> list:
    unit = Unit("a", "linear", (("a", "Linear", (256, 256), torch.float32),), 256 * 256 * 4, 0)
    decode = 1e-8
    figs = figures(
        decode_seconds={"bfloat16": 0, "float8": decode, "8bit": 0, "int8": decode * int8_share, "nf4": 0, "fp4": 0}
    )
    return options_for(
        unit,
        storages=frozenset({"float8", "int8"}),
        placements=frozenset({"device"}),
        device=torch.device("cpu"),
        rows={"a": 8},
        live={},
        figures=figs,
    )


@pytest.mark.parametrize(("int8_share", "tie"), [(0.9, True), (0.3, False)])
def test_options_of_about_equal_time_tie_and_noise_does_not_change_the_pick(int8_share, tie):
    # float8 comes before int8 in the catalogue (same precision rank): int8 counts as faster only when more than 25% faster
    float8, int8 = options = _float8_and_int8(int8_share)
    assert int8.seconds < float8.seconds
    assert (int8.cost == pytest.approx(float8.cost, rel=1e-3)) is tie  # up to the noise tie-break, which int8 wins
    pick = options[search([options], budget=10**7, activations=0).best.picks[0]].storage
    even = _float8_and_int8(1.0)
    assert pick == (even[search([even], budget=10**7, activations=0).best.picks[0]].storage if tie else "int8")


class _WithBuffer(nn.Module):
    """Two Linear units and, outside them, a buffer its constructor computes (as rotary frequencies)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64, bias=False)
        self.second = nn.Linear(64, 64, bias=False)
        self.register_buffer("frequencies", torch.arange(256, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)) * self.frequencies[:64]


def _keep_or_int8_on_device_or_disk(unit: Unit) -> list:
    """The unit's options for a load plan, kept or int8, on the device or on disk."""
    return options_for(
        unit,
        storages=frozenset({"keep", "int8"}),
        placements=frozenset({"device", "disk"}),
        device=torch.device("cpu"),
        rows={},
        live={},
        figures=figures(),
        loading=True,
    )


def test_the_load_peak_counts_the_skeletons_buffers_from_the_first_unit_streamed_in():
    # the rest streams in last, but its buffers (computed by the skeleton) are there before the first byte is read
    model = _WithBuffer().eval()
    assert [(u.name, u.buffer_bytes) for u in find_units(model)] == [("first", 0), ("second", 0), ("(rest)", 1024)]
    options = {u.name: _keep_or_int8_on_device_or_disk(u) for u in find_units(model)}
    assert [o.ready_bytes for o in options["(rest)"]] == [1024] and not options["first"][0].ready_bytes
    int8 = next(i for i, o in enumerate(options["first"]) if (o.storage, o.placement) == ("int8", "device"))
    disk = next(i for i, o in enumerate(options["second"]) if (o.storage, o.placement) == ("keep", "disk"))
    first, rest = options["first"][int8], options["(rest)"][0]
    choice = peak_of([options["first"], options["second"], options["(rest)"]], (int8, disk, 0), 0)
    # converting the first unit is the peak: the buffer is beside it, not only counted when the rest streams in
    assert choice.load_peak_bytes == first.held_bytes + first.load_bytes + 1024
    assert choice.load_peak_bytes > first.held_bytes + rest.held_bytes
    assert choice.peak_bytes >= choice.load_peak_bytes


def test_bytes_held_while_loading_raise_the_load_peak_above_each_unit_once_and_not_the_runs():
    model = _WithBuffer().eval()
    units = [_keep_or_int8_on_device_or_disk(u) for u in find_units(model)]
    picks = (0, 0, 0)
    assert peak_of(units, picks, 0, 333).load_peak_bytes == peak_of(units, picks, 0).load_peak_bytes + 333
    x = torch.randn(4, 64)
    plain = tightfit.fit(model, (x,), "1MiB", calibration=figures(), loading=True)
    held = {"checking": 5000}
    reserved = {"scales": 700}
    plan = tightfit.fit(
        model, (x,), "1MiB", calibration=figures(), loading=True, reserve=reserved, reserve_loading=held
    )
    assert plan.reserved == reserved and plan.reserved_loading == held
    assert plan.predicted_load_peak_bytes == plain.predicted_load_peak_bytes + 700 + 5000
    assert plan.predicted_peak_bytes == max(plain.predicted_peak_bytes + 700, plan.predicted_load_peak_bytes)
    assert "checking 4.9 KiB (5,000 B)" in str(plan)
    # the load's reservation is what leaves no room: the error names it among the parts
    tight = plain.predicted_peak_bytes + 700 + 10
    with pytest.raises(FitError, match="held while loading") as raised:
        tightfit.fit(
            model,
            (x,),
            tight,
            allow={"placement": {"device"}, "storage": {"keep"}},
            calibration=figures(),
            loading=True,
            reserve=reserved,
            reserve_loading=held,
        )
    assert ("checking", 5000) in raised.value.parts


@pytest.mark.parametrize(
    ("keywords", "match"),
    [
        (dict(reserve_loading={"checking": 10}), "needs loading=True"),
        (dict(loading=True, reserve_loading={"checking": -1}), "reserve_loading"),
        (dict(loading=True, reserve_loading={"": 1}), "reserve_loading keys"),
        (dict(loading=True, reserve_loading=[1]), "reserve_loading must be a dict"),
        (dict(reserve={"kv": 2**40}), "cannot be met: what is reserved"),
    ],
)
def test_bad_reservations_are_refused_naming_the_argument(keywords, match):
    with pytest.raises((TypeError, ValueError, FitError), match=match):
        tightfit.fit(_WithBuffer().eval(), (torch.randn(4, 64),), "1MiB", calibration=figures(), **keywords)


def test_a_buffer_on_meta_is_read_with_its_unit_and_not_counted_from_the_start():
    # a pre-quantized layer's stand-in registers its packed weight as a buffer on meta: the
    # checkpoint fills it when its unit streams in (counting it from the start over-predicted
    # a bitsandbytes folder's load peak by 61%)
    model = _WithBuffer().eval()
    model.second.register_buffer("packed", torch.empty(512, dtype=torch.uint8, device="meta"))
    assert [(u.name, u.buffer_bytes) for u in find_units(model)] == [("first", 0), ("second", 0), ("(rest)", 1024)]


def test_a_tensor_stored_in_another_dtype_is_read_converted_and_its_unit_not_mapped_in_place():
    # the first weight is stored in bfloat16 (the headers say so), the model computes in float32
    model = _WithBuffer().eval()
    stored = {"first.weight": torch.bfloat16, "second.weight": torch.float32}
    units = {u.name: u for u in find_units(model, stored)}
    assert units["first"].converted == ("first.weight",) and units["first"].read_bytes == 64 * 64 * 2
    assert not units["second"].converted and not units["second"].read_bytes
    options = {
        name: {(o.storage, o.placement): o for o in _keep_or_int8_on_device_or_disk(unit)}
        for name, unit in units.items()
    }
    weight = 64 * 64 * 4
    # on disk: read, converted (the stored copy beside it) and written to an offload file, not mapped
    assert options["first"]["keep", "disk"].load_bytes == weight + 64 * 64 * 2
    assert options["first"]["keep", "disk"].held_bytes == 0
    assert options["first"]["keep", "device"].load_bytes == 64 * 64 * 2  # above the weight it holds
    assert options["second"]["keep", "disk"].load_bytes == 0  # mapped in place
    # both kept on the device: the peak is the second unit's read, with the first held and the buffer
    x, later = torch.randn(2, 64), {"second.weight": torch.bfloat16}
    plan = tightfit.fit(model, (x,), "1MiB", calibration=figures(), loading=True, stored_dtypes=later)
    unchanged = tightfit.fit(model, (x,), "1MiB", calibration=figures(), loading=True)
    assert unchanged.predicted_load_peak_bytes == 2 * weight + 1024
    assert plan.predicted_load_peak_bytes == 2 * weight + 1024 + 64 * 64 * 2


def test_stored_dtypes_are_checked():
    model, x = _WithBuffer().eval(), torch.randn(2, 64)
    with pytest.raises(ValueError, match="stored_dtypes describes a checkpoint to load; it is taken only with"):
        tightfit.fit(model, (x,), "1MiB", calibration=figures(), stored_dtypes={"first.weight": torch.bfloat16})
    with pytest.raises(TypeError, match=r"stored_dtypes\['first.weight'\] must be dtype, got str"):
        tightfit.fit(model, (x,), "1MiB", calibration=figures(), loading=True, stored_dtypes={"first.weight": "bf16"})
    with pytest.raises(TypeError, match="stored_dtypes must be Mapping, got list"):
        tightfit.fit(model, (x,), "1MiB", calibration=figures(), loading=True, stored_dtypes=[])


def _one_linear_options(rows: int, token_seconds: dict) -> dict:
    unit = Unit("a", "linear", (("a", "Linear", (256, 256), torch.float32),), 256 * 256 * 4, 0)
    options = options_for(
        unit,
        storages=frozenset({"keep", "nf4"}),
        placements=frozenset({"device"}),
        device=torch.device("cpu"),
        rows={"a": rows},
        live={},
        figures=figures(
            decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 0, "nf4": 1e-6, "fp4": 0},
            token_seconds=token_seconds,
        ),
    )
    return {option.storage: option.seconds for option in options}


def test_few_token_forwards_are_priced_by_the_one_token_figures():
    """Up to FEW_TOKENS rows, a Linear costs its storage's measured one-token seconds per weight
    (the fused kernels read the codes in the product); above, the decode and matmul figures."""
    fast_nf4 = {"float32": {"keep": 2e-9, "nf4": 1e-9}}
    few = _one_linear_options(tightfit.ops.FEW_TOKENS, fast_nf4)
    assert few["keep"] == pytest.approx(256 * 256 * 2e-9) and few["nf4"] == pytest.approx(256 * 256 * 1e-9)
    many = _one_linear_options(tightfit.ops.FEW_TOKENS + 1, fast_nf4)
    assert many["nf4"] > 256 * 256 * 1e-6 > many["keep"]  # the slow decode figure prices it
    unmeasured = _one_linear_options(1, {"float32": {"keep": 2e-9}})  # a storage without a one-token figure
    assert unmeasured["nf4"] > 256 * 256 * 1e-6  # the decode and matmul terms
    other_dtype = _one_linear_options(1, {"bfloat16": {"keep": 2e-9, "nf4": 1e-9}})  # figures of bfloat16 layers
    assert other_dtype["nf4"] > 256 * 256 * 1e-6 and other_dtype["keep"] != pytest.approx(256 * 256 * 2e-9)


def test_decode_steps_price_one_token_forwards_apart_from_the_traced_one():
    # int8's prefill decodes slowly and its one-token kernel is cheap; disk costs a read per forward:
    # a prefill alone goes to disk, a prefill and 64 decode steps keep the units in int8 on the device
    model = four_linears()
    prefill = torch.randn(64, 256)
    figs = figures(
        decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 1e-7, "nf4": 0, "fp4": 0},
        token_seconds={"float32": {"keep": 1e-10, "int8": 1e-10}},
        disk_bandwidth=1e8,
    )
    allow = {"storage": {"keep", "int8"}, "placement": {"device", "disk"}}
    budget = 700 * 1024
    alone = tightfit.fit(model, (prefill,), budget, allow=allow, calibration=figs)
    assert [e.placement for e in alone.entries].count("disk") >= 2 and alone.decode_steps == 0
    generating = tightfit.fit(model, (prefill,), budget, allow=allow, calibration=figs, decode_steps=64)
    assert {(e.storage, e.placement) for e in generating.changed_entries()} == {("int8", "device")}
    assert generating.decode_steps == 64 and "of the planned forward and 64 one-token forwards" in str(generating)
    # its time: the prefill's plus 64 one-token forwards', each unit's own
    assert (
        generating.predicted_seconds
        > tightfit.fit(model, (prefill,), budget, allow=allow, calibration=figs, decode_steps=1).predicted_seconds
    )
    with pytest.raises(ValueError, match=r"decode_steps must be an int >= 0, got -1"):
        tightfit.fit(model, (prefill,), budget, calibration=figs, decode_steps=-1)


def _available(monkeypatch, free: int | None) -> None:
    """The host's memory as the planner reads it: ``free`` bytes available."""
    from tightfit.backends.base import MemoryInfo
    from tightfit.backends.cpu import CPUBackend

    monkeypatch.setattr(CPUBackend, "memory", lambda self, device=None: MemoryInfo(None, free, None, None, "test"))


@pytest.mark.parametrize("free", [1 << 40, 1 << 19, None], ids=["roomy", "tight", "unknown"])
def test_disk_reads_are_priced_from_the_page_cache_only_where_the_model_fits_in_available_memory(monkeypatch, free):
    # int8 decodes slowly and disk is slower: where the page cache holds the mapped weights (the
    # model's 1 MiB fits in what the host has available), disk costs what memory does and wins
    model = four_linears()
    figs = figures(
        decode_seconds={"bfloat16": 0, "float8": 0, "8bit": 0, "int8": 1e-7, "nf4": 0, "fp4": 0},
        disk_bandwidth=1e7,  # a unit's 256 KiB read in 26 ms, its int8 decode 6.6 ms
        cached_read_bandwidth=1e10,
    )
    _available(monkeypatch, free)
    allow = {"storage": {"keep", "int8"}, "placement": {"device", "disk"}}
    plan = tightfit.fit(model, (X,), 700 * 1024, allow=allow, calibration=figs)
    changed = {(e.storage, e.placement) for e in plan.changed_entries()}
    if free == 1 << 40:
        assert changed == {("keep", "disk")} and plan.disk_reads.startswith("from the page cache at 10.0 GB/s")
        assert "units on disk read from the page cache" in str(plan)
    else:  # priced at the cold disk's 0.01 GB/s a forward: int8 is faster
        assert changed == {("int8", "device")} and plan.disk_reads == ""
    allow_disk = {"storage": {"keep"}, "placement": {"device", "disk"}}
    cold = tightfit.fit(model, (X,), 700 * 1024, allow=allow_disk, calibration=figures(disk_bandwidth=1e8))
    assert cold.disk_reads.endswith("no page-cache read figure in the calibration")
    if free == 1 << 19:
        tight = tightfit.fit(model, (X,), 700 * 1024, allow=allow_disk, calibration=figs)
        assert tight.disk_reads.endswith("the model's 1.0 MiB may not stay in the page cache (512.0 KiB available)")


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "fast"])
def test_a_bad_page_cache_figure_is_refused(value):
    with pytest.raises((ValueError, TypeError), match="cached_read_bandwidth must be a finite number > 0"):
        figures(cached_read_bandwidth=value)
