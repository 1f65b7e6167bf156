"""Offloading: to CPU memory and to memory-mapped disk files, block and leaf units, prefetch order,
composition with casting, exact removal, bad inputs; on a GPU (skipped without one) the
copies, the side-stream prefetch and the memory they save. Damaged files, full disks and
killed processes are in test_offload_files.py."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
from torch import nn

from tightfit.hooks import (
    OFFLOADING,
    HookRegistry,
    apply_layerwise_casting,
    apply_offloading,
    remove_layerwise_casting,
    remove_offloading,
    resident_bytes,
)
from tightfit.hooks._disk import MappedFile
from tightfit.memory import tensor_bytes
from zoo.hooks import bert_and_output, cosine, held_files, same_state, snapshot, stack

F8 = torch.float8_e4m3fn
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LINUX = sys.platform == "linux"


def state_of(module):
    return HookRegistry.get(module).hook(OFFLOADING).state


def test_cpu_storage_on_the_cpu_is_a_no_op():
    model = stack()
    x = torch.randn(2, 32)
    expected, saved = model(x), snapshot(model)
    assert apply_offloading(model, "cpu") == ["0", "1", "2"]
    assert not any(HookRegistry.get(m).hook(OFFLOADING).moves for m in model)  # nothing to copy
    assert HookRegistry.get(model) is None  # and nothing to prefetch: no schedule on the root
    assert torch.equal(model(x), expected)
    assert resident_bytes(model, "cpu") == tensor_bytes([*model.parameters(), *model.buffers()])
    remove_offloading(model)
    assert same_state(model, saved)


@pytest.mark.parametrize("granularity", ["block", "leaf"])
def test_disk_storage_maps_unnamed_files_and_removal_restores_bit_for_bit(tmp_path, granularity):
    model = stack()
    x = torch.randn(2, 32)
    expected, saved = model(x), snapshot(model)
    apply_offloading(model, "cpu", offload_to="disk", granularity=granularity, path=tmp_path)
    assert len(state_of(model[0].up if granularity == "leaf" else model[0]).files) == (
        3 if granularity == "block" else 9
    )
    assert list(tmp_path.iterdir()) == []  # no names: nothing to find, nothing left behind
    if LINUX:
        assert len(held_files(os.getpid(), tmp_path)) == len(
            state_of(model[0].up if granularity == "leaf" else model[0]).files
        )
    assert resident_bytes(model, "cpu") == 0  # every weight lives in the page cache of a mapped file
    assert torch.equal(model(x), expected) and torch.equal(model(x), expected)
    remove_offloading(model)
    assert same_state(model, saved)
    assert all(HookRegistry.get(m) is None for m in model.modules())
    gc.collect()
    if LINUX:
        assert held_files(os.getpid(), tmp_path) == set()  # closed: the OS has freed the space


def test_prefetch_learns_the_order_and_reads_the_next_file_ahead(tmp_path, monkeypatch):
    model = stack()
    read_ahead = []
    monkeypatch.setattr(MappedFile, "will_need", lambda self: read_ahead.append(self.unit))
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    x = torch.randn(2, 32)
    model(x)  # first pass: records the order
    state = state_of(model[0])
    assert [HookRegistry.get(m).hook(OFFLOADING) for m in model] == state.schedule.order and read_ahead == []
    model(x)
    assert read_ahead == ["0", "1", "2"]
    remove_offloading(model)
    read_ahead.clear()
    apply_offloading(model, "cpu", offload_to="disk", prefetch=False, path=tmp_path)
    model(x)
    model(x)
    assert read_ahead == [] and HookRegistry.get(model) is None


def test_composes_with_casting_float8_on_disk(tmp_path):
    model = stack()
    x = torch.randn(2, 32)
    apply_layerwise_casting(model, F8, torch.float32)
    with torch.no_grad():
        cast_only = model(x)
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    assert model[0].up.weight.dtype == F8 and resident_bytes(model, "cpu") == 0
    with torch.no_grad():
        assert torch.equal(model(x), cast_only)
    remove_offloading(model)
    remove_layerwise_casting(model)


def test_state_dict_while_offloaded_loads_into_a_plain_model(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = stack()
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    safetensors.save_file(model.state_dict(), tmp_path / "saved.safetensors")
    plain = stack(seed=1)
    plain.load_state_dict(safetensors.load_file(tmp_path / "saved.safetensors"))
    x = torch.randn(2, 32)
    assert torch.equal(plain(x), model(x))


def test_a_transformers_model_on_disk(tmp_path):
    model, ids, expected = bert_and_output()
    saved = snapshot(model)
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, expected)
    remove_offloading(model)
    assert same_state(model, saved)


def test_under_compile(tmp_path):
    model = stack(depth=2)
    x = torch.randn(2, 32)
    expected = model(x)
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    compiled = torch.compile(model, backend="eager")  # the read-ahead (madvise) is a graph break, not an error
    model(x)
    assert torch.equal(compiled(x), expected)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"device": "cuda:0"} if not torch.cuda.is_available() else {"device": "cuda:99"},
            RuntimeError if not torch.cuda.is_available() else ValueError,
            "not available on this machine|does not exist",
        ),
        ({"device": "nonesuch"}, ValueError, "backend 'nonesuch' is not known"),
        ({"device": 0}, TypeError, "device must be a str or torch.device"),
        ({"offload_to": "tape"}, ValueError, "offload_to='tape' is not accepted"),
        (
            {"offload_to": "disk", "storage": "cpu"},
            TypeError,
            "pass offload_to='disk' alone: storage='cpu' is its deprecated old name",
        ),
        ({"granularity": "layer"}, ValueError, "granularity='layer' is not accepted"),
        ({"prefetch": "yes"}, TypeError, "prefetch must be bool"),
        (
            {"pin_memory": True},
            ValueError,
            "pin_memory=True needs offload_to='cpu' and a device with asynchronous copies",
        ),
        ({"path": "/nonexistent/folder", "offload_to": "disk"}, ValueError, "is not an existing folder"),
        ({"path": "/tmp"}, ValueError, "path is only used with offload_to='disk'"),
    ],
)
def test_bad_input(kwargs, error, match):
    model = stack(depth=1)
    arguments = {"device": "cpu", **kwargs}
    with pytest.raises(error, match=match):
        apply_offloading(model, arguments.pop("device"), **arguments)
    assert HookRegistry.get(model[0]) is None


def test_the_old_storage_keyword_still_works_with_a_warning(tmp_path):
    model = stack(depth=1)
    with pytest.warns(DeprecationWarning, match="storage=...\\) is deprecated; use offload_to"):
        apply_offloading(model, "cpu", storage="disk", path=tmp_path)
    assert HookRegistry.get(model[0]).hook(OFFLOADING).state.offload_to == "disk"
    remove_offloading(model)


def test_bad_state(tmp_path):
    model = stack(depth=1)
    with pytest.raises(ValueError, match="no offloading is applied"):
        remove_offloading(model)
    apply_offloading(model, "cpu")
    with pytest.raises(ValueError, match="already applied"):
        apply_offloading(model, "cpu")
    odd = nn.Sequential(nn.Linear(2, 2))
    odd[0].register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="dtype torch.complex64, which an offload file does not hold"):
        apply_offloading(odd, "cpu", offload_to="disk", path=tmp_path)


# -- on a GPU (skipped here) -------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("offload_to", ["cpu", "disk"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_gpu_offloading_computes_on_the_device_with_weights_off_it(tmp_path, offload_to, prefetch):
    model = stack(width=256, depth=4)
    x = torch.randn(4, 256)
    expected = model.cuda()(x.cuda())
    saved = snapshot(model)
    apply_offloading(
        model, "cuda", offload_to=offload_to, prefetch=prefetch, path=tmp_path if offload_to == "disk" else None
    )
    assert resident_bytes(model, "cuda") == 0 and model[0].up.weight.device.type == "cpu"
    if offload_to == "cpu":
        assert model[0].up.weight.is_pinned()
    torch.cuda.synchronize()
    for _ in range(3):
        assert torch.allclose(model(x.cuda()), expected, atol=1e-6)
    remove_offloading(model)
    assert same_state(model, saved)


@cuda
def test_gpu_prefetch_uses_a_side_stream_and_holds_at_most_two_units():
    model = stack(width=512, depth=6)
    apply_offloading(model, "cuda")
    x = torch.randn(8, 512, device="cuda")
    model(x)
    state = state_of(model[0])
    assert len(state.schedule.order) == 6 and state.side_stream is not None
    unit = tensor_bytes([*model[0].parameters()])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 3 * unit  # current unit, next unit, activations


@cuda
def test_gpu_prefetch_holds_two_units_when_the_copies_bound_the_run():
    """Big weights and one token: the device waits on the copies, the host runs ahead of
    it, and each unit's dropped copy stays allocated until the device is done with it.
    Prefetch waits for the unit before the current one, so two units are held at most."""
    model = stack(width=2048, depth=8)
    apply_offloading(model, "cuda")
    x = torch.randn(1, 2048, device="cuda")
    unit = tensor_bytes([*model[0].parameters()])
    with torch.no_grad():
        model(x)  # records the order
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 2.5 * unit


@cuda
def test_gpu_a_failed_store_offloads_nothing(monkeypatch):
    model = stack(width=64).cuda()
    saved, pin, calls = snapshot(model), torch.Tensor.pin_memory, []

    def out_of_pinned_memory(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:  # in the second block
            raise RuntimeError("out of pinned memory")
        return pin(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", out_of_pinned_memory)
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        apply_offloading(model, "cuda")
    assert same_state(model, saved) and all(HookRegistry.get(m) is None for m in model.modules())


@cuda
def test_gpu_casting_and_offloading_store_float8_on_the_cpu_and_compute_bf16_on_the_gpu():
    model = stack(width=256, depth=3).to(torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    expected = model.cuda()(x.cuda())
    apply_layerwise_casting(model, F8, torch.bfloat16)
    apply_offloading(model, "cuda")
    assert model[0].up.weight.dtype == F8 and model[0].up.weight.device.type == "cpu"
    with torch.no_grad():
        assert cosine(model(x.cuda()), expected) > 0.999
    remove_offloading(model)
    remove_layerwise_casting(model)
