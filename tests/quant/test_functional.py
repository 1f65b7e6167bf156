"""``tightfit.quant.functional`` and ``QuantState``: the bitsandbytes API and checkpoint
format, both ways through safetensors files."""

from __future__ import annotations

import pytest
import torch

from tightfit.quant import QuantState
from tightfit.quant import functional as F

bnb = pytest.importorskip("bitsandbytes.functional")
safetensors = pytest.importorskip("safetensors.torch")


def weight(shape=(96, 70), dtype=torch.bfloat16, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("compress_statistics", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_checkpoint_written_by_bitsandbytes_loads_in_tightfit(tmp_path, quant_type, compress_statistics):
    W = weight()
    packed, state = bnb.quantize_4bit(W, blocksize=64, quant_type=quant_type, compress_statistics=compress_statistics)
    tensors = {"weight": packed, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    safetensors.save_file(tensors, tmp_path / "model.safetensors")
    loaded = safetensors.load_file(tmp_path / "model.safetensors")
    ours = QuantState.from_dict({k.removeprefix("weight."): v for k, v in loaded.items() if k != "weight"})
    assert ours.quant_type == quant_type and ours.nested == compress_statistics and ours.shape == W.shape
    assert torch.equal(F.dequantize_4bit(loaded["weight"], ours), bnb.dequantize_4bit(packed, state))


@pytest.mark.parametrize("compress_statistics", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_checkpoint_written_by_tightfit_loads_in_bitsandbytes(tmp_path, quant_type, compress_statistics):
    W = weight(dtype=torch.float16)
    packed, state = F.quantize_4bit(W, blocksize=128, quant_type=quant_type, compress_statistics=compress_statistics)
    safetensors.save_file({"weight": packed, **state.as_dict(packed=True)}, tmp_path / "model.safetensors")
    loaded = safetensors.load_file(tmp_path / "model.safetensors")
    theirs = bnb.QuantState.from_dict({k: v for k, v in loaded.items() if k != "weight"}, device="cpu")
    assert torch.equal(bnb.dequantize_4bit(loaded["weight"], theirs), F.dequantize_4bit(packed, state))


def test_same_codes_and_state_as_bitsandbytes_4bit_nested():
    W = weight((256, 256), torch.float32, seed=2)
    packed, state = F.quantize_4bit(W, quant_type="nf4", compress_statistics=True)
    their_packed, their_state = bnb.quantize_4bit(W, quant_type="nf4", compress_statistics=True)
    assert torch.equal(packed, their_packed)
    assert torch.equal(state.offset, their_state.offset)
    # the nested 8-bit codes come from bitsandbytes' approximate CPU kernel on their side,
    # so compare what they decode to rather than the codes themselves
    ours, theirs = F.dequantize_4bit(packed, state), bnb.dequantize_4bit(their_packed, their_state)
    assert (ours - theirs).abs().max() <= 0.02 * W.abs().max()


@pytest.mark.parametrize("nested", [False, True])
def test_8bit_functional_roundtrip_and_bitsandbytes_decoding(nested):
    A = weight((64, 300), torch.float32, seed=3)
    q, state = F.quantize_blockwise(A, blocksize=256, nested=nested)
    ours = F.dequantize_blockwise(q, state)
    assert ours.dtype == torch.float32 and (ours - A).abs().mean() < 0.011
    their_state = bnb.QuantState(
        absmax=state.absmax,
        code=state.code,
        blocksize=256,
        dtype=torch.float32,
        offset=state.offset,
        state2=None
        if not nested
        else bnb.QuantState(absmax=state.state2.absmax, code=state.state2.code, blocksize=256, dtype=torch.float32),
    )
    assert torch.equal(bnb.dequantize_blockwise(q, their_state), ours)


def test_out_and_absmax_buffers_are_filled():
    A = weight((64, 64), torch.float32)
    out = torch.empty(64, 64, dtype=torch.uint8)
    absmax = torch.empty(1)
    q, state = F.quantize_blockwise(A, out=out, absmax=absmax)
    assert q is out and state.absmax is absmax
    decoded = torch.empty(64, 64)
    assert F.dequantize_blockwise(q, state, out=decoded) is decoded


def test_state_moves_between_devices_as_a_copy():
    _, state = F.quantize_4bit(weight(), compress_statistics=True, quant_type="nf4")
    moved = state.to("cpu")
    assert moved is not state and torch.equal(moved.absmax, state.absmax) and moved.state2 is not state.state2


def test_unpacked_dict_roundtrip():
    _, state = F.quantize_4bit(weight(), quant_type="fp4")
    again = QuantState.from_dict(state.as_dict())
    assert (
        again.quant_type == "fp4"
        and again.blocksize == 64
        and again.dtype == torch.bfloat16
        and torch.equal(again.absmax, state.absmax)
    )


def test_state_tensors_are_every_tensor_it_holds():
    _, plain = F.quantize_4bit(weight((96, 64)), quant_type="nf4")  # 6144 values: 96 blocks of 64
    assert [tuple(t.shape) for t in plain.tensors()] == [(96,), (16,)]
    _, nested = F.quantize_4bit(weight((96, 64)), compress_statistics=True, quant_type="nf4")
    held = nested.tensors()
    assert (
        len(held) == 5 and held[0].dtype == torch.uint8 and held[2] is nested.offset and held[3] is nested.state2.absmax
    )


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: QuantState(absmax=[1.0], code=torch.zeros(16), blocksize=64, dtype=torch.float32),
            TypeError,
            "absmax must be a Tensor",
        ),
        (
            lambda: QuantState(
                absmax=torch.ones(1), code=torch.zeros(16), blocksize=63, dtype=torch.float32, quant_type="nf4"
            ),
            ValueError,
            "blocksize=63",
        ),
        (
            lambda: QuantState(absmax=torch.ones(1), code=torch.zeros(16), blocksize=64, dtype=torch.int8),
            ValueError,
            "dtype=torch.int8",
        ),
        (
            lambda: QuantState(
                absmax=torch.ones(1), code=torch.zeros(16), blocksize=64, dtype=torch.float32, quant_type="int4"
            ),
            ValueError,
            "quant_type='int4'",
        ),
        (
            lambda: QuantState(
                absmax=torch.ones(1), code=torch.zeros(16), blocksize=64, dtype=torch.float32, offset=torch.tensor(1.0)
            ),
            ValueError,
            "go together",
        ),
        (lambda: QuantState.from_dict([]), TypeError, "items must be dict"),
        (lambda: QuantState.from_dict({"absmax": torch.ones(1)}), ValueError, "missing"),
        (
            lambda: QuantState.from_dict(
                {
                    "absmax": torch.ones(1),
                    "quant_map": torch.zeros(16),
                    "quant_state.bitsandbytes__nf4": torch.tensor([123], dtype=torch.uint8),
                }
            ),
            ValueError,
            "valid UTF-8 JSON",
        ),
        (
            lambda: QuantState.from_dict(
                {"absmax": torch.ones(1), "quant_map": torch.zeros(16), "blocksize": 64, "dtype": "int8"}
            ),
            ValueError,
            "dtype='int8' is not accepted",
        ),
        (lambda: F.dequantize_blockwise(torch.zeros(4, dtype=torch.uint8)), ValueError, "needs quant_state"),
        (
            lambda: F.dequantize_4bit(torch.zeros(4, dtype=torch.uint8), absmax=torch.ones(1)),
            ValueError,
            "needs quant_state, or both",
        ),
        (
            lambda: F.dequantize_4bit(torch.zeros(4, dtype=torch.uint8), quant_state="state"),
            TypeError,
            "quant_state must be QuantState",
        ),
        (lambda: F.quantize_4bit(torch.ones(8), compress_statistics=1), TypeError, "compress_statistics must be bool"),
        (
            lambda: F.quantize_blockwise(torch.ones(8), out=torch.empty(3, dtype=torch.uint8)),
            ValueError,
            "out must have shape",
        ),
    ],
)
def test_bad_input(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matmul_4bit_single_token_and_batch_agree_with_decoded_weight(dtype):
    W = weight((200, 128), torch.float32, seed=9)
    packed, state = F.quantize_4bit(W, quant_type="nf4", compress_statistics=True)
    decoded = F.dequantize_4bit(packed, state)
    bias = torch.randn(200)
    for x in (torch.randn(1, 1, 128), torch.randn(4, 128)):
        x = x.to(dtype)
        got = F.matmul_4bit(x, packed, state, bias=bias)
        expected = torch.nn.functional.linear(x.float(), decoded, bias)
        assert got.dtype == dtype and got.shape == (*x.shape[:-1], 200)
        assert ((got.float() - expected) ** 2).sum() / (expected**2).sum() < 1e-4


def test_gemv_4bit_signature_checks():
    packed, state = F.quantize_4bit(weight((8, 64), torch.float32), quant_type="fp4")
    with pytest.raises(ValueError, match="transposed_A and transposed_B are not supported"):
        F.gemv_4bit(torch.randn(1, 64), packed, transposed_B=True, state=state)
    with pytest.raises(ValueError, match=r"A has (63 features|shape \(1, 63\))"):
        F.gemv_4bit(torch.randn(1, 63), packed, state=state)
    with pytest.raises(ValueError, match="quant_state must describe a 4-bit weight"):
        F.matmul_4bit(torch.randn(1, 64), packed, F.quantize_blockwise(torch.randn(64))[1])
