"""The peer library in compatibility tests: bitsandbytes checked against the specification.

A compatibility test proves what the two libraries share (codes, scales, state-dict keys and
bytes, layout, checkpoints read both ways) and compares tightfit's decoded values and
outputs with the specification: tightfit's reference kernels (DESIGN D4), applied to the
bytes either library stored. bitsandbytes' own decode is checked against the same
specification separately, through :class:`PeerCheck`: where its kernels on this machine
depart from it, the test ends as an xfail that names the bitsandbytes function and the
measured deviation, after every tightfit assertion has run; where they agree, it passes.

Measured with bitsandbytes 0.50.2 on an Intel Xeon with AVX-512 (avx512_bf16): its CPU
``dequantize_4bit`` reads blocks per row of the last dimension and decodes wrongly where
that dimension is not a multiple of the blocksize; its AVX512-bf16 weight repacking
(``_convert_weight_packed_for_cpu``, run at the first eval forward of a ``Linear4bit``)
raises on layers with fewer input features than the blocksize; its ``int8_linear_matmul``
is wrong at K = 1. On CPUs with AVX2 only its kernels agree with the specification.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tightfit.ops import get_op

__all__ = ["PeerCheck", "SpecLinear", "StoredState", "spec_dequantize_4bit", "spec_model"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PACKED_KEY = "quant_state.bitsandbytes__"


def spec_dequantize_4bit(packed: torch.Tensor, state: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The specification's decode of 4-bit codes: tightfit's reference kernels on ``packed``
    and a QuantState of either library (nested scales decoded by the 8-bit reference plus
    the offset, in float32), in ``dtype`` (default: the state's)."""
    absmax = state.absmax
    if state.nested:
        nested = state.state2
        absmax = get_op("dequantize_blockwise").reference(
            absmax, nested.absmax, nested.code, nested.blocksize, torch.float32
        )
        absmax = absmax + state.offset
    shape = list(state.shape)
    return get_op("dequantize_4bit").reference(
        packed, absmax.float(), state.blocksize, state.quant_type, shape, dtype or state.dtype
    )


class StoredState:
    """A 4-bit QuantState read straight from its stored entries (``absmax``, ``quant_map``,
    ..., ``quant_state.bitsandbytes__nf4``: the format in DESIGN.md), with neither library's
    reader, for :func:`spec_dequantize_4bit`."""

    def __init__(self, entries: dict[str, torch.Tensor]) -> None:
        (packed,) = [key for key in entries if key.startswith(_PACKED_KEY)]
        meta = json.loads(bytes(entries[packed].tolist()).decode("utf-8"))
        self.quant_type = meta["quant_type"]
        self.blocksize = meta["blocksize"]
        self.dtype = _DTYPES[meta["dtype"]]
        self.shape = tuple(meta["shape"])
        self.absmax = entries["absmax"]
        self.nested = "nested_absmax" in entries
        if self.nested:
            self.state2 = _NestedState(entries["nested_absmax"], entries["nested_quant_map"], meta["nested_blocksize"])
            self.offset = torch.tensor(meta["nested_offset"], dtype=torch.float32)


class _NestedState:
    def __init__(self, absmax: torch.Tensor, code: torch.Tensor, blocksize: int) -> None:
        self.absmax, self.code, self.blocksize = absmax, code, blocksize


class SpecLinear(nn.Module):
    """A 4-bit layer as the specification computes it: the weight decoded by the reference
    kernel straight into the compute dtype, ``linear(x.to(compute), weight, bias)`` cast back
    to ``x``'s dtype (bitsandbytes' ``Linear4bit`` with ``compute_dtype``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = self.weight.dtype
        bias = None if self.bias is None else self.bias.to(compute)
        return F.linear(x.to(compute), self.weight, bias).to(x.dtype)


def _stored_entries(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    entries: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        entries.update(load_file(file))
    return entries


def spec_model(folder: str | os.PathLike[str]) -> nn.Module:
    """The transformers model of a folder saved with a bitsandbytes 4-bit
    quantization_config, as the specification computes it: a plain model from the config
    without the quantization, the stored float tensors loaded as they are and every 4-bit
    weight decoded from its stored codes and scales by the reference kernel into a
    :class:`SpecLinear` in ``bnb_4bit_compute_dtype``. Neither library's loader runs."""
    import transformers

    folder = Path(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    quantization = config.quantization_config
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    del config.quantization_config
    compute = quantization.get("bnb_4bit_compute_dtype") or "float32"
    compute = _DTYPES[str(compute).removeprefix("torch.")]
    entries = _stored_entries(folder)
    if any(key.endswith(".SCB") for key in entries):
        raise ValueError(f"{folder} holds int8 weights; spec_model decodes 4-bit ones only")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    decoded = set()
    for key in [key for key in entries if f".weight.{_PACKED_KEY}" in key]:
        prefix = key.split(f".weight.{_PACKED_KEY}")[0]
        own = {
            name.removeprefix(f"{prefix}.weight."): entries.pop(name)
            for name in list(entries)
            if name.startswith(f"{prefix}.weight.")
        }
        weight = spec_dequantize_4bit(entries.pop(f"{prefix}.weight"), StoredState(own), compute)
        parent, _, name = prefix.rpartition(".")
        setattr(model.get_submodule(parent), name, SpecLinear(weight, entries.pop(f"{prefix}.bias", None)))
        decoded.add(f"{prefix}.weight")
    missing, unexpected = model.load_state_dict(entries, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or not set(missing) <= decoded | tied:
        raise ValueError(
            f"{folder}: entries {unexpected} not in the model; {sorted(set(missing) - decoded - tied)} missing"
        )
    return model.eval()


def _bitsandbytes_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``error``'s traceback, if it lies in bitsandbytes' own package
    (not tightfit.compat.bitsandbytes)."""
    import bitsandbytes

    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    innermost = frames[-1]
    package = Path(bitsandbytes.__file__).resolve().parent
    return innermost if Path(innermost.filename).resolve().is_relative_to(package) else None


def _machine() -> str:
    import bitsandbytes
    import bitsandbytes.functional as BF

    return (
        f"bitsandbytes {bitsandbytes.__version__}, torch CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, has_avx512bf16() {bool(BF.has_avx512bf16())}"
    )


class PeerCheck:
    """bitsandbytes' results held to the specification, apart from tightfit's assertions.

    :meth:`agrees` compares a result of bitsandbytes with the specification's; :meth:`runs`
    calls bitsandbytes and notes an exception raised inside bitsandbytes' own code (any
    other propagates); once bitsandbytes has raised, its objects may be half-changed, so
    later :meth:`runs` calls are skipped. :meth:`settle`, called after the test's own
    assertions, ends the test as an xfail listing every deviation, or does nothing."""

    def __init__(self) -> None:
        self.deviations: list[str] = []
        self.crashed = False

    def agrees(
        self,
        function: str,
        peer: torch.Tensor | None,
        spec: torch.Tensor,
        *,
        atol: float = 0.0,
        original: torch.Tensor | None = None,
    ) -> bool:
        """Whether ``peer`` (bitsandbytes' result of ``function``) equals ``spec`` (within
        ``atol``); if not, the deviation is noted. ``original``: the values quantized, to
        state both decodes' mean error. ``peer`` None (bitsandbytes raised) is skipped."""
        if peer is None:
            return False
        if peer.shape != spec.shape or peer.dtype != spec.dtype:
            self.deviations.append(
                f"{function} gives {peer.dtype} {tuple(peer.shape)} where the specification gives "
                f"{spec.dtype} {tuple(spec.shape)}"
            )
            return False
        difference = (peer.detach().double() - spec.detach().double()).abs()
        if torch.equal(peer, spec) or (atol and bool((difference <= atol).all())):
            return True
        message = (
            f"{function} deviates from the specification: {int((difference > atol).sum())} of "
            f"{difference.numel()} values differ, mean |bitsandbytes - spec| {float(difference.mean()):.3g}, "
            f"max {float(difference.max()):.3g}"
        )
        if original is not None:
            errors = [float((x.detach().double() - original.double()).abs().mean()) for x in (peer, spec)]
            message += f"; mean error against the values quantized {errors[0]:.3f} (spec {errors[1]:.3f})"
        self.deviations.append(message)
        return False

    def decode_agrees(self, weight: Any) -> bool:
        """Whether bitsandbytes' CPU ``dequantize_4bit`` of its own 4-bit ``weight`` (a
        ``Params4bit``) equals the specification's decode of the same bytes; if not, noted.
        Its layers' outputs are compared with tightfit's only where it does."""
        import bitsandbytes.functional as BF

        spec = spec_dequantize_4bit(weight.data, weight.quant_state)
        return self.agrees(
            "bitsandbytes.functional.dequantize_4bit", BF.dequantize_4bit(weight.data, weight.quant_state), spec
        )

    def runs(self, function: str, call: Callable[[], Any]) -> Any:
        """``call()``'s result, or None where it raised inside bitsandbytes (noted) or where
        bitsandbytes raised earlier in this check."""
        if self.crashed:
            return None
        try:
            return call()
        except Exception as error:
            frame = _bitsandbytes_frame(error)
            if frame is None:
                raise
            self.crashed = True
            where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
            self.deviations.append(f"{function} raises {type(error).__name__}: {error} ({where})")
            return None

    def settle(self) -> None:
        """After the test's own assertions: xfail naming every deviation noted, if any."""
        if self.deviations:
            pytest.xfail(
                f"bitsandbytes departs from its specification on this CPU ({_machine()}): " + "; ".join(self.deviations)
            )
