"""``QuantState``: what it takes to decode a quantized tensor, and its serialized form.

The serialized form is the dict bitsandbytes and transformers write into safetensors,
so checkpoints move between the two libraries: tensors ``absmax``, ``quant_map``
(and ``nested_absmax``, ``nested_quant_map`` with double quantization) plus one uint8
tensor ``quant_state.bitsandbytes__nf4`` (or ``__fp4``) holding UTF-8 JSON with
quant_type, blocksize, dtype, shape, nested_blocksize, nested_dtype, nested_offset.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from tightfit._validate import check_device
from tightfit.ops._arg_checks import MAX_BLOCKSIZE_8BIT
from tightfit.ops.blockwise import BLOCKSIZES_4BIT, FLOAT_DTYPES
from tightfit.ops.codes import QUANT_TYPES_4BIT
from tightfit.quant._checkpoint import DTYPE_NAMES, read_quant_state

__all__ = ["QuantState", "PACKED_KEY_8BIT", "PACKED_KEY_PREFIX"]

PACKED_KEY_PREFIX = "quant_state.bitsandbytes__"
#: bitsandbytes has no format for blockwise 8-bit weights; tightfit packs them under this key.
PACKED_KEY_8BIT = "quant_state.tightfit__blockwise8"


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal shape, dtype, device and values; a meta tensor has no values, so only itself."""
    if a is None or b is None or a.device.type == "meta" or b.device.type == "meta":
        return a is b
    return (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) and torch.equal(a, b)


@dataclass(frozen=True, eq=False)
class QuantState:
    """Scales and metadata of a blockwise-quantized tensor.

    ``absmax`` holds one scale per block; with double quantization (``state2`` set) it
    holds the 8-bit codes of ``absmax - offset`` and ``state2`` decodes them.
    ``quant_type`` is "nf4" / "fp4" for 4-bit, None for 8-bit.

    ``==`` compares by value, as bitsandbytes' QuantState does (code written against it
    compares a state with its reloaded copy): the fields equal and the tensors equal in
    shape, dtype, device and every value, exactly (bitsandbytes allows 1e-6), so equal states
    decode bit-equal. Therefore unhashable: equal states may hold different tensor objects.
    """

    __hash__ = None  # type: ignore[assignment]

    absmax: torch.Tensor
    code: torch.Tensor
    blocksize: int
    dtype: torch.dtype
    shape: torch.Size | None = None
    quant_type: str | None = None
    offset: torch.Tensor | None = None
    state2: QuantState | None = None

    def __post_init__(self) -> None:
        for name in ("absmax", "code"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"QuantState.{name} must be a Tensor, got {type(value).__name__}")
        if self.quant_type is not None and self.quant_type not in QUANT_TYPES_4BIT:
            raise ValueError(f"QuantState.quant_type={self.quant_type!r} is not accepted; accepted: nf4, fp4, None")
        if self.quant_type:
            accepted, valid = ", ".join(map(str, BLOCKSIZES_4BIT)), self.blocksize in BLOCKSIZES_4BIT
        else:  # the 8-bit ops take any block size, as bitsandbytes does
            accepted = f"an int from 1 to {MAX_BLOCKSIZE_8BIT}"
            valid = isinstance(self.blocksize, int) and 1 <= self.blocksize <= MAX_BLOCKSIZE_8BIT
        if isinstance(self.blocksize, bool) or not valid:
            raise ValueError(f"QuantState.blocksize={self.blocksize!r} is not accepted; accepted: {accepted}")
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"QuantState.dtype={self.dtype!r} is not accepted; accepted: float32, float16, bfloat16")
        if self.shape is not None:
            object.__setattr__(self, "shape", torch.Size(self.shape))
        if (self.offset is None) != (self.state2 is None):
            raise ValueError("QuantState.offset and QuantState.state2 go together (double quantization) or not at all")
        if self.state2 is not None and not isinstance(self.state2, QuantState):
            raise TypeError(f"QuantState.state2 must be a QuantState, got {type(self.state2).__name__}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuantState):
            return NotImplemented
        return (
            (self.blocksize, self.dtype, self.shape, self.quant_type)
            == (other.blocksize, other.dtype, other.shape, other.quant_type)
            and _same_tensor(self.absmax, other.absmax)
            and _same_tensor(self.code, other.code)
            and _same_tensor(self.offset, other.offset)
            and self.state2 == other.state2
        )

    @property
    def nested(self) -> bool:
        """Whether ``absmax`` is itself quantized (double quantization)."""
        return self.state2 is not None

    def to(self, device: torch.device | str) -> QuantState:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            absmax=self.absmax.to(device),
            code=self.code.to(device),
            offset=None if self.offset is None else self.offset.to(device),
            state2=None if self.state2 is None else self.state2.to(device),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this state holds (scales, code map, and the nested state's), for memory accounting."""
        held = [self.absmax, self.code]
        if self.state2 is not None:
            held += [self.offset, *self.state2.tensors()]
        return held

    def as_dict(self, packed: bool = False) -> dict[str, Any]:
        """The bitsandbytes dict; ``packed=True`` gives only tensors, ready for safetensors
        (4-bit under bitsandbytes' key, 8-bit under ``quant_state.tightfit__blockwise8``)."""
        items: dict[str, Any] = {
            "quant_type": self.quant_type,
            "absmax": self.absmax,
            "blocksize": self.blocksize,
            "quant_map": self.code,
            "dtype": DTYPE_NAMES[self.dtype],
            "shape": tuple(self.shape) if self.shape is not None else None,
        }
        if self.nested:
            items.update(
                nested_absmax=self.state2.absmax,
                nested_blocksize=self.state2.blocksize,
                nested_quant_map=self.state2.code.clone(),  # a separate tensor: safetensors drops shared ones
                nested_dtype=DTYPE_NAMES[self.state2.dtype],
                nested_offset=float(self.offset),
            )
        if not packed:
            return items
        tensors = {key: value for key, value in items.items() if isinstance(value, torch.Tensor)}
        metadata = {key: value for key, value in items.items() if not isinstance(value, torch.Tensor)}
        key = PACKED_KEY_PREFIX + self.quant_type if self.quant_type else PACKED_KEY_8BIT
        tensors[key] = torch.tensor(list(json.dumps(metadata).encode("utf-8")), dtype=torch.uint8)
        return tensors

    @classmethod
    def from_dict(cls, items: dict[str, Any], device: torch.device | str = "cpu") -> QuantState:
        """Rebuild a state from :meth:`as_dict` output, packed or not, keys with or without
        prefixes. Everything read is checked first (types, lengths, finite scales >= 0, the
        code tables, the JSON): a damaged entry raises ValueError or TypeError naming it."""
        fields = read_quant_state(items)
        device = check_device("device", device)
        state2 = offset = None
        if "nested_absmax" in fields:
            state2 = cls(
                absmax=fields["nested_absmax"].to(device),
                code=fields["nested_quant_map"].to(device),
                blocksize=fields["nested_blocksize"],
                dtype=fields["nested_dtype"],
            )
            offset = torch.tensor(fields["nested_offset"], dtype=torch.float32, device=device)
        return cls(
            absmax=fields["absmax"].to(device),
            code=fields["quant_map"].to(device),
            blocksize=fields["blocksize"],
            dtype=fields["dtype"],
            shape=fields["shape"],
            quant_type=fields["quant_type"],
            offset=offset,
            state2=state2,
        )
