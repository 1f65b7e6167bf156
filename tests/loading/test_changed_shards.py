"""A shard replaced or rewritten after its header was read is not read with the old
header's offsets (D9), however its times were set back: every re-check compares the
file's identity stamp (device, inode, size, modification and status-change times), and
a shard changed just before it was opened is compared by its header bytes too."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import pytest
import torch

import tightfit
from tightfit._files import file_stamp
from tightfit.hooks import OffloadFileError
from tightfit.hooks._disk import MappedRegions
from tightfit.loading import Checkpoint, plan_folder
from tightfit.loading import safetensors as reader
from tightfit.loading import stream as streaming
from zoo.lm import figures


def _shard(path, order: tuple[str, str], values: dict[str, float]) -> None:
    """Two float32 tensors of 4 values, laid out in ``order``: a same-size file whose
    header swaps the two offsets reads each tensor from the other's bytes."""
    header, data = {}, b""
    for name in order:
        header[name] = {"dtype": "F32", "shape": [4], "data_offsets": [len(data), len(data) + 16]}
        data += torch.full((4,), values[name]).numpy().tobytes()
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _old(tmp_path) -> tuple[Checkpoint, os.stat_result]:
    _shard(tmp_path / "model.safetensors", ("a", "b"), {"a": 1.0, "b": 2.0})
    checkpoint = Checkpoint(tmp_path)
    return checkpoint, os.stat(tmp_path / "model.safetensors")


def _set_back(path, old: os.stat_result) -> None:
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))


def _replace_by_rename(tmp_path, old) -> None:
    """rsync -t, tar x: a new file, its times set back, renamed over the old one."""
    new = tmp_path / "incoming"
    _shard(new, ("b", "a"), {"a": 1.0, "b": 2.0})
    _set_back(new, old)
    os.replace(new, tmp_path / "model.safetensors")


def _rewrite_in_place(tmp_path, old) -> None:
    """cp -p: the same inode truncated and written again, its times set back."""
    time.sleep(0.05)  # past the file system's timestamp tick, as any later copy is
    new = tmp_path / "source"
    _shard(new, ("b", "a"), {"a": 1.0, "b": 2.0})
    with open(tmp_path / "model.safetensors", "r+b") as file:
        file.write(new.read_bytes())
    _set_back(tmp_path / "model.safetensors", old)


@pytest.mark.parametrize("replace", [_replace_by_rename, _rewrite_in_place])
def test_a_same_size_shard_with_its_times_set_back_is_not_read(tmp_path, replace):
    checkpoint, old = _old(tmp_path)
    replace(tmp_path, old)
    now = os.stat(tmp_path / "model.safetensors")
    assert (now.st_size, now.st_mtime_ns) == (old.st_size, old.st_mtime_ns)  # what the old check compared
    for call in (checkpoint.read, checkpoint.check):
        with pytest.raises(ValueError, match="model.safetensors changed on disk after its header was checked"):
            call("a")


def test_a_removed_shard_is_refused_as_changed(tmp_path):
    checkpoint, _ = _old(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="changed on disk"):
        checkpoint.check("a")


def test_a_shard_rewritten_within_one_tick_is_caught_by_its_header(tmp_path, monkeypatch):
    """A coarse clock (a FAT or network file system, or a rewrite in the same tick) keeps
    both times: the stamp is the same, and only a shard changed just before it was opened
    has its header compared. Simulated with a stamp that ignores the times."""
    monkeypatch.setattr(reader, "file_stamp", lambda stat: (stat.st_dev, stat.st_ino, stat.st_size))
    checkpoint, old = _old(tmp_path)  # just written: its header is kept to compare
    with open(tmp_path / "model.safetensors", "r+b") as file:
        new = tmp_path / "source"
        _shard(new, ("b", "a"), {"a": 1.0, "b": 2.0})
        file.write(new.read_bytes())
    with pytest.raises(ValueError, match="changed on disk after its header was checked"):
        checkpoint.read("a")
    monkeypatch.setattr(reader, "_RACY_NS", 0)  # a shard unchanged for long: its stamp alone is compared
    _shard(tmp_path / "model.safetensors", ("a", "b"), {"a": 1.0, "b": 2.0})
    assert torch.equal(Checkpoint(tmp_path).read("a"), torch.full((4,), 1.0))


def test_an_unchanged_shard_reads_each_tensor_from_its_own_bytes(tmp_path, monkeypatch):
    for racy in (3_000_000_000, 0):
        monkeypatch.setattr(reader, "_RACY_NS", racy)
        checkpoint, _ = _old(tmp_path)
        assert (tmp_path / "model.safetensors" in checkpoint._racy) is bool(racy)
        assert torch.equal(checkpoint.read("a"), torch.full((4,), 1.0))
        assert torch.equal(checkpoint.read("b"), torch.full((4,), 2.0))


def test_a_shard_mapped_in_place_must_be_the_one_whose_header_was_read(tmp_path):
    checkpoint, old = _old(tmp_path)
    entry = checkpoint.entries["a"]
    regions = {"a": (entry.start, entry.nbytes, entry.dtype, entry.shape)}
    mapped = MappedRegions(entry.file, "unit", regions, checkpoint.stamp(entry.file))
    assert torch.equal(mapped.tensors["a"], torch.full((4,), 1.0))
    mapped.close()
    _replace_by_rename(tmp_path, old)
    with pytest.raises(OffloadFileError, match="had been replaced or written to since its header was read"):
        MappedRegions(entry.file, "unit", regions, checkpoint.stamp(entry.file))


def test_the_stamp_tells_a_replaced_file_from_its_old_self(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 16)
    old = os.stat(path)
    other = tmp_path / "g"
    other.write_bytes(b"y" * 16)
    _set_back(other, old)
    os.replace(other, path)
    assert file_stamp(os.stat(path)) != file_stamp(old)
    assert file_stamp(os.stat(path))[2:4] == (old.st_size, old.st_mtime_ns)


@pytest.mark.parametrize("budget", [40_000_000, 9_000_000])  # read into memory; the vocabularies mapped from disk
def test_load_refuses_a_shard_replaced_after_its_header_was_read(tiny_llama, tmp_path, monkeypatch, budget):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    shard = folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    opened = Checkpoint.__init__

    def then_replaced(self, path):
        opened(self, path)
        old = os.stat(shard)
        time.sleep(0.05)
        incoming = folder / "incoming"
        incoming.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))  # same size, one byte changed
        _set_back(incoming, old)
        os.replace(incoming, shard)

    monkeypatch.setattr(Checkpoint, "__init__", then_replaced)
    model, plan = plan_folder(folder, budget, calibration=figures())
    assert any(entry.placement == "disk" for entry in plan.entries) is (budget < 10_000_000)
    with pytest.raises((ValueError, OffloadFileError), match="model.safetensors"):
        tightfit.load(folder, plan=plan, model=model)
    assert streaming.Checkpoint is Checkpoint
