"""The checkpoint reader refuses what is not a valid safetensors file (D9), naming the
file and the tensor, and reads what is one exactly as the safetensors library does."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tightfit.loading import Checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")


def _write(path, header: object, data: bytes = b"", raw: bytes | None = None) -> None:
    text = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_reads_what_the_safetensors_library_wrote(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7, dtype=torch.float64).to(torch.bfloat16),
        "c": torch.arange(11, dtype=torch.int64),
        "d": torch.randn(2, 2).to(torch.float8_e4m3fn),
        "e": torch.zeros(0, 4),
    }
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.metadata == {"format": "pt"} and set(checkpoint.entries) == set(tensors)
    for name, tensor in tensors.items():
        read = checkpoint.read(name)
        assert read.dtype == tensor.dtype and torch.equal(read.view(torch.uint8), tensor.view(torch.uint8))


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"w": _entry(offsets=(0, 8))}, b"\0" * 4, r"data_offsets \[0, 8\], past the end of the file's 4 bytes"),
        ({"w": _entry(offsets=(0, 4))}, b"\0" * 8, r"data_offsets \[0, 4\]; accepted: \[begin, begin \+ 8\]"),
        ({"w": _entry(dtype="F99")}, b"\0" * 8, "has dtype 'F99'"),
        ({"w": _entry(shape=(-2,))}, b"\0" * 8, "has shape"),
        ({"w": {"dtype": "F32"}}, b"", "must be an object with dtype, shape and data_offsets"),
        ({"w": _entry(), "v": _entry()}, b"\0" * 8, "overlap"),
        ([1, 2], b"", "must be a JSON object"),
        ({"__metadata__": {"a": 1}}, b"", "__metadata__ must be an object of strings"),
    ],
)
def test_a_bad_header_is_refused_naming_the_tensor(tmp_path, header, data, message):
    _write(tmp_path / "model.safetensors", header, data)
    with pytest.raises(ValueError, match=message):
        Checkpoint(tmp_path)


def test_a_header_longer_than_the_file_and_a_stub_are_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="its header claims"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\1\2")
    with pytest.raises(ValueError, match="shorter than its header length"):
        Checkpoint(tmp_path)
    _write(tmp_path / "model.safetensors", None, raw=b"\xff{not json")
    with pytest.raises(ValueError, match="its safetensors header is not valid JSON"):
        Checkpoint(tmp_path)


def test_an_index_naming_a_missing_or_escaping_shard_is_refused(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model-00001.safetensors"}}))
    with pytest.raises(ValueError, match="is missing; the checkpoint's index names it"):
        Checkpoint(tmp_path)
    index.write_text(json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match="maps tensor names to shard file names"):
        Checkpoint(tmp_path)
    index.unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="convert them to safetensors"):
        Checkpoint(tmp_path)


def test_a_shard_changed_after_opening_is_not_read(tmp_path):
    safetensors_torch.save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    checkpoint = Checkpoint(tmp_path)
    with open(tmp_path / "model.safetensors", "ab") as file:
        file.write(b"more")
    with pytest.raises(ValueError, match="changed on disk after its header was checked"):
        checkpoint.read("w")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=st.dictionaries(
        st.text(max_size=4),
        st.one_of(
            st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(["F32", "BF16", "I8", "U8", "BOOL", "X", 3]),
                    "shape": st.lists(st.integers(-3, 6), max_size=3),
                    "data_offsets": st.lists(st.integers(-10, 80), min_size=0, max_size=3),
                }
            ),
            st.integers(),
            st.text(max_size=3),
        ),
        max_size=4,
    ),
    data=st.binary(max_size=64),
)
def test_any_header_either_reads_every_tensor_or_is_refused(tmp_path, header, data):
    _write(tmp_path / "model.safetensors", header, data)
    try:
        checkpoint = Checkpoint(tmp_path)
    except ValueError:
        return
    for name, entry in checkpoint.entries.items():
        tensor = checkpoint.read(name)
        assert tuple(tensor.shape) == entry.shape and tensor.dtype == entry.dtype
