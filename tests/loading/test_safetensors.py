"""The checkpoint reader refuses what is not a valid safetensors file (D9), naming the
file and the tensor, and reads what is one exactly as the safetensors library does."""

from __future__ import annotations

import json
import re
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


_A = b'"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'
_B = b'"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}'


@pytest.mark.parametrize(
    "header, data, message",
    [
        (  # Python's json keeps the last definition: "a" would read b's bytes
            b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}',
            b"abcd",
            "names 'a' twice",
        ),
        (b'{"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"ab", "names 'dtype' twice"),
        (
            b'{"__metadata__":{"x":"1"},"__metadata__":{"y":"2"},' + _A + b"}",
            b"ab",
            "names '__metadata__' twice",
        ),
        (
            b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}',
            b"abXcd",
            "there are 1 bytes between tensors 'a' and 'b'",
        ),
        (b"{" + _A + b"}", b"abX", "its data holds 1 bytes after tensor 'a', which no entry covers"),
        (b"{}", b"zz", "its data holds 2 bytes and no tensor"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"Xab", "tensor 'a' is the first in the data but"),
        (b"{" + _A + b"," + _B.replace(b"[2,4]", b"[1,3]") + b"}", b"abc", "tensors 'a' and 'b' overlap"),
        (b'{"__metadata__":[1],' + _A + b"}", b"ab", "__metadata__ must be an object of strings, got list"),
        (b'{"__metadata__":"x",' + _A + b"}", b"ab", "__metadata__ must be an object of strings, got str"),
        (b'{"__metadata__":0,' + _A + b"}", b"ab", "__metadata__ must be an object of strings, got int"),
        (b'{"__metadata__":false,' + _A + b"}", b"ab", "__metadata__ must be an object of strings, got bool"),
        (b'{"__metadata__":{"x":1},' + _A + b"}", b"ab", "__metadata__ must be an object of strings"),
        (b"\xef\xbb\xbf{" + _A + b"}", b"ab", "Unexpected UTF-8 BOM"),
        (b'{"__metadata__":{"x":NaN},' + _A + b"}", b"ab", "holds NaN, which is not JSON"),
        (b'{"\\ud800":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"ab", "lone surrogate"),
        (b'{"a":{"dtype":"U8","shape":[0, 9223372036854775808],"data_offsets":[0,0]}}', b"", "at most"),
        (b'{"__metadata__":' + b"[" * 5000 + b"]" * 5000 + b"," + _A + b"}", b"ab", "nested too deeply"),
        (b"{" + _A + b"}\x00\x00", b"ab", "Extra data"),
    ],
)
def test_what_the_safetensors_format_refuses_is_refused_naming_the_file_and_entry(tmp_path, header, data, message):
    """Each as the safetensors library refuses it (or, for names and fields given twice,
    stricter: the library keeps the last, which can be another tensor's bytes)."""
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + data)
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        Checkpoint(tmp_path)
    assert str(file) in str(refused.value)
    if b'"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a"' not in header:
        with pytest.raises(Exception):  # noqa: B017 (the library raises its own SafetensorError)
            safetensors_torch.load_file(file)


@pytest.mark.parametrize(
    "header, data",
    [
        (b'{"__metadata__":null,' + _A + b"}", b"ab"),  # null metadata: none
        (b" \n{" + _A + b"}   ", b"ab"),  # whitespace around the JSON (the padding writers add)
        (b'{"z":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},' + _A + b"}", b"ab"),  # an empty tensor at the end
        (b'{"a":{"dtype":"U32","shape":[1],"data_offsets":[0,4]}}', b"abcd"),
        (b'{"a":{"dtype":"F8_E8M0","shape":[1],"data_offsets":[0,1]}}', b"a"),
    ],
)
def test_what_the_format_accepts_is_read_as_the_library_reads_it(tmp_path, header, data):
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + data)
    checkpoint = Checkpoint(tmp_path)
    expected = safetensors_torch.load_file(file)
    assert set(checkpoint.entries) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.read(name).reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_a_bool_tensor_holding_other_bytes_than_0_and_1_is_refused(tmp_path):
    header = b'{"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}}'
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\x00\x01\x05")
    with pytest.raises(ValueError, match="tensor 'm' is BOOL but holds a byte of value 5; accepted: 0 and 1"):
        Checkpoint(tmp_path).read("m")


def test_a_header_longer_than_the_library_s_limit_is_refused(tmp_path):
    with open(tmp_path / "model.safetensors", "wb") as file:
        file.write(struct.pack("<Q", 100_000_001))
        file.truncate(8 + 100_000_001)  # sparse: the file is long enough, the header too long
    with pytest.raises(
        ValueError, match="claims 100000001 bytes; the file has 100000001 after the length, and headers above 100000000"
    ):
        Checkpoint(tmp_path)


def test_an_index_naming_a_shard_with_a_nul_or_a_backslash_is_refused(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    for name in ("model.safetensors\u0000", "sub\\model.safetensors"):
        index.write_text(json.dumps({"weight_map": {"w": name}}))
        with pytest.raises(ValueError, match="maps tensor names to shard file names"):
            Checkpoint(tmp_path)


def test_an_index_nested_too_deeply_is_refused_naming_it(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map":' * 50_000 + "{}" + "}" * 50_000)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not valid JSON: nested too deeply"):
        Checkpoint(tmp_path)


def test_tied_names_holding_different_values_are_refused(tmp_path):
    safetensors_torch.save_file(
        {"e": torch.ones(4), "h": torch.zeros(4), "s": torch.ones(4)}, tmp_path / "model.safetensors"
    )
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.source(["e", "s"], "") == "e"  # the same values: one tensor for both
    assert checkpoint.source(["e", "missing"], "") == "e"
    with pytest.raises(ValueError, match="ties e, h .* holds 'e' and 'h' with different values"):
        checkpoint.source(["e", "h"], "")
