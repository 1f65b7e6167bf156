"""Corrupted quantized checkpoints: the hostile-input cases of checkpoint loading (D9).

A case is a list of mutations of a valid state dict (of a Linear4bit, Linear8bit or
LinearInt8) or of a QuantState's dict. Each mutation makes the data invalid or leaves
its meaning unchanged: it drops, renames, adds or retypes an entry, reshapes a tensor,
changes its dtype, puts NaN, inf or a negative value in a float tensor that cannot hold
one, or damages the packed JSON (fields set to values of the wrong type or out of range,
bytes cut or replaced, other JSON, deep nesting, huge numbers). A change to another
valid value (a different finite scale, another accepted blocksize, a flipped code
byte) cannot be told from real data without a checksum, so it is never generated, and
the packed weights' bytes are never changed.

Each key gets at most one mutation per case, so that two mutations cannot repair each
other into valid data of another meaning. :func:`run_load` and :func:`run_from_dict`
return the outcome of one case: "loaded" (equal to the reference), "refused"
(ValueError or TypeError, the layer unchanged), "reported" (absent entries in
``missing_keys``, or torch's strict-mode RuntimeError listing missing or unexpected
keys, the layer unchanged or equal to the reference), or "FAIL: ..." for anything else.
:func:`make_case` and :func:`run_case` make it a campaign target: ``python -m
tightfit.quant.fuzz --count N`` runs cases in worker processes, so a crash or a hang is
blamed on its case.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import math
import random
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tightfit._fuzz_campaign import main
from tightfit.quant import Linear4bit, Linear8bit, LinearInt8, QuantizedLinear, QuantState
from tightfit.quant import functional as F

KINDS = {
    "nf4": lambda linear: Linear4bit.from_linear(linear, quant_type="nf4"),
    "fp4-nested": lambda linear: Linear4bit.from_linear(
        linear, quant_type="fp4", blocksize=32, compress_statistics=True
    ),
    "8bit": lambda linear: Linear8bit.from_linear(linear, blocksize=64),
    "8bit-nested": lambda linear: Linear8bit.from_linear(linear, blocksize=64, nested=True),
    "int8": lambda linear: LinearInt8.from_linear(linear),
}
STATE_KINDS = ("nf4", "fp4-nested", "8bit", "8bit-nested")
CLEAN = (ValueError, TypeError)

_NON_TENSORS = (0, 1.5, "abc", None, [1, 2], {"a": 1}, b"\x00", True)
_BLOCKSIZES = (0, -64, 63, 65, 8192, 10**30, 64.0, "64", True, None, [64], math.nan)
_DTYPE_NAMES = ("float64", "int8", "torch.float32", "", 32, None, ["float32"])
#: values no valid writer puts in a field (other valid values are not generated, see above).
FIELD_VALUES = {
    "quant_type": ("int4", "NF4", "", 4, ["nf4"], {"a": 1}, True),
    "blocksize": _BLOCKSIZES,
    "nested_blocksize": _BLOCKSIZES,
    "dtype": _DTYPE_NAMES,
    "nested_dtype": _DTYPE_NAMES,
    "shape": ([], [-1, 64], [7, "37"], "7x37", [7.0, 37], [True, 37], [10**30, 37], [[7], [37]], {"0": 7}, 7),
    "nested_offset": (math.nan, math.inf, -math.inf, "nan", "0.5", -1.0, None, [], 1e39, 10**400, True),
}
_RESHAPES = ("flatten", "unsqueeze", "drop_last", "append", "empty", "scalar", "transpose")
_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "complex64",
)
_VALUES = ("nan", "inf", "-inf", "negative")
_NAMES = (
    "absmax",
    "quant_map",
    "nested_absmax",
    "nested_quant_map",
    "quant_state.bitsandbytes__nf4",
    "quant_state.bitsandbytes__fp4",
    "quant_state.tightfit__blockwise8",
    "quant_state.bitsandbytes__int4",
    "SCB",
    "bias",
    "weight",
    "weight_format",
    "blocksize",
)
#: whole replacements of the packed JSON: other JSON, broken JSON, deep nesting, huge numbers, bad UTF-8.
_BLOBS = (
    b"",
    b"null",
    b"[]",
    b"42",
    b'"nf4"',
    b"{",
    b"{}",
    b"NaN",
    b"\xff\xfe{}",
    b"[" * 60000,
    b'{"a":' * 12000,
    b"9" * 5000,
    b'{"blocksize": ' + b"9" * 5000 + b"}",
    b'{"quant_type": "nf4"}',
    b"[" * 70000,
)
#: bytes that break JSON wherever they land (outside a string they unbalance it; inside one
#: they make a name or value that no field accepts).
_BAD_BYTES = (0xFF, 0x00, ord("{"), ord("["))


def linear(seed: int, out_features: int = 7, in_features: int = 37) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


#: kind -> (reference layer, fresh layer holding other values); built once per process.
_LAYERS: dict[str, tuple[nn.Module, nn.Module]] = {}


def layers(kind: str) -> tuple[nn.Module, nn.Module]:
    if kind not in _LAYERS:
        _LAYERS[kind] = KINDS[kind](linear(seed=0)), KINDS[kind](linear(seed=1))
    return _LAYERS[kind]


@functools.cache
def reference(kind: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    module = layers(kind)[0]
    return module, dict(module.state_dict())


@functools.cache
def _fresh_snapshot(kind: str) -> list[torch.Tensor]:
    return snapshot(layers(kind)[1])


def fresh(kind: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """A copy of the layer of ``kind`` that holds other values than the reference (stale
    scales would show), and its snapshot."""
    return copy.deepcopy(layers(kind)[1]), _fresh_snapshot(kind)


def state_items(kind: str, packed: bool) -> dict[str, Any]:
    """The reference's QuantState as ``from_dict`` reads it, packed (tensors only) or not."""
    return reference(kind)[0].quant_state.as_dict(packed=packed)


def is_packed(key: str) -> bool:
    return key.split(".")[-1].startswith(("bitsandbytes__", "tightfit__"))


def draw_mutations(rng: random.Random, items: dict[str, Any]) -> list[tuple]:
    """One to three mutations, each on a different key of ``items`` (or adding one)."""
    keys = rng.sample(sorted(items), k=min(len(items), rng.randint(1, 3)))
    mutations = []
    for key in keys:
        value = items[key]
        ops = ["drop", "rename"]
        if isinstance(value, torch.Tensor):
            ops += ["retype", "reshape"]
            if key.split(".")[-1] != "bias":  # a bias of another float dtype is copied in, as nn.Linear does
                ops.append("dtype")
            if value.is_floating_point() and key.split(".")[-1] not in ("weight", "bias"):
                ops.append("value")
            if is_packed(key):
                ops += ["json", "json", "bytes", "bytes"]
        elif key.split(".")[-1] in FIELD_VALUES:  # metadata of an unpacked state: only values no writer writes
            ops += ["field", "field"]
        op = rng.choice(ops)
        if op == "drop":
            mutations.append(("drop", key))
        elif op == "rename":
            prefix = "weight." if key.startswith("weight.") else ""
            target = rng.choice([key + "_", "x." + key, prefix + rng.choice(_NAMES)])
            if target not in items:
                mutations.append(("rename", key, target))
        elif op == "retype":
            mutations.append(("set", key, rng.choice(_NON_TENSORS)))
        elif op == "field":
            mutations.append(("set", key, rng.choice(FIELD_VALUES[key.split(".")[-1]])))
        elif op == "reshape":
            mutations.append(("reshape", key, rng.choice(_RESHAPES)))
        elif op == "dtype":
            mutations.append(("dtype", key, rng.choice(_DTYPES)))
        elif op == "value":
            mutations.append(("value", key, rng.choice(_VALUES), rng.randrange(value.numel()) if value.numel() else 0))
        elif op == "json":
            field = rng.choice(sorted(FIELD_VALUES) + ["extra"])
            what = rng.choice(["set", "set", "drop"])
            mutations.append(
                ("json", key, field, "drop" if what == "drop" else rng.choice(FIELD_VALUES.get(field, (1,))))
            )
        else:
            how = rng.choice(["cut", "byte", "blob"])
            arg = rng.choice(_BLOBS) if how == "blob" else rng.randrange(value.numel())
            mutations.append(("bytes", key, how, arg, rng.choice(_BAD_BYTES)))
    if rng.random() < 0.2:
        mutations.append(_addition(rng, items))
    return mutations


def _addition(rng: random.Random, items: dict[str, Any]) -> tuple:
    """A new entry: an unknown one, a lone nested one, a second packed one, a weight_format."""
    prefix = "weight." if "weight" in items else ""
    candidates = [
        (prefix + "extra", torch.ones(2)),
        (prefix + "nested_absmax", torch.ones(1)),
        ("weight_format", torch.tensor(rng.choice([0, 1]), dtype=torch.uint8)),
    ]
    candidates += [
        (key.rsplit(".", 1)[0] + ".bitsandbytes__" + quant_type, value)
        for key, value in items.items()
        if is_packed(key)
        for quant_type in ("nf4", "fp4")
    ]
    key, value = rng.choice([(key, value) for key, value in candidates if key not in items])
    return ("add", key, value)


def _reshape(tensor: torch.Tensor, how: str) -> torch.Tensor:
    flat = tensor.reshape(-1)
    if how == "flatten":
        return flat
    if how == "unsqueeze":
        return tensor.unsqueeze(0)
    if how == "drop_last":
        return flat[:-1]
    if how == "append":
        return torch.cat([flat, flat[:1]])
    if how == "empty":
        return flat[:0]
    if how == "scalar":
        return flat[0] if flat.numel() else flat.sum()
    return tensor.t() if tensor.dim() == 2 else tensor.unsqueeze(-1)


def _set_value(tensor: torch.Tensor, how: str, index: int) -> torch.Tensor:
    """NaN or inf at ``index``, or the last value made the smallest and negative (so a
    scale turns negative and a sorted code table unsorted)."""
    flat = tensor.clone().reshape(-1)
    if flat.numel():
        if how == "negative":
            flat[-1] = -float(flat.abs().max()) - 1.0
        else:
            flat[index % flat.numel()] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[how]
    return flat.reshape(tensor.shape)


def _json_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def apply(items: dict[str, Any], mutations: list[tuple]) -> dict[str, Any]:
    """``items`` with ``mutations`` applied (a new dict; the tensors of ``items`` are not written)."""
    out = dict(items)
    for op, key, *args in mutations:
        if op == "add":
            out[key] = args[0]
        elif key not in out:
            continue
        elif op == "drop":
            del out[key]
        elif op == "rename":
            out[args[0]] = out.pop(key)
        elif op == "set":
            out[key] = args[0]
        elif op == "reshape":
            out[key] = _reshape(out[key], args[0])
        elif op == "dtype":
            out[key] = out[key].to(getattr(torch, args[0]))
        elif op == "value":
            out[key] = _set_value(out[key], *args)
        elif op == "json":
            metadata = json.loads(bytes(out[key].tolist()))
            field, value = args
            if value == "drop":
                metadata.pop(field, None)
            else:
                metadata[field] = value
            out[key] = _json_tensor(json.dumps(metadata).encode())
        else:  # bytes
            how, arg, bad_byte = args
            data = bytes(out[key].tolist())
            if how == "cut":
                data = data[:arg]
            elif how == "byte":
                data = data[:arg] + bytes([bad_byte]) + data[arg + 1 :]
            else:
                data = arg
            out[key] = _json_tensor(data)
    return out


def snapshot(module: nn.Module) -> list[torch.Tensor]:
    tensors = [module.weight, module.dequantize()] + ([] if module.bias is None else [module.bias])
    if isinstance(module, QuantizedLinear):
        tensors += module.quant_state.tensors()
    else:
        tensors.append(module.SCB)
    return [t.detach().clone() for t in tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)
    )


def _behaviour(module: nn.Module) -> list[torch.Tensor]:
    """What a user sees: the decoded weight, the bias, the output for one token."""
    x = torch.linspace(-2, 2, module.in_features).reshape(1, module.in_features)
    with torch.no_grad():
        return [module.dequantize()] + ([] if module.bias is None else [module.bias.detach()]) + [module(x)]


@functools.cache
def _expected(kind: str) -> list[torch.Tensor]:
    return _behaviour(reference(kind)[0])


def _strict_report_only(error: RuntimeError) -> bool:
    lines = str(error).splitlines()
    return lines[0].startswith("Error(s) in loading state_dict") and all(
        line.strip().startswith(("Missing key(s)", "Unexpected key(s)")) for line in lines[1:] if line.strip()
    )


def run_load(kind: str, mutations: list[tuple], strict: bool) -> str:
    """Load the mutated reference state dict into a fresh layer; the outcome (see above)."""
    try:
        expected = _expected(kind)
        module, before = fresh(kind)
        state_dict = apply(reference(kind)[1], mutations)
        try:
            result = module.load_state_dict(state_dict, strict=strict)
        except CLEAN:
            return "refused" if same(snapshot(module), before) else "FAIL: a refused load changed the layer"
        except RuntimeError as error:
            if not (strict and _strict_report_only(error)):
                raise
            if same(snapshot(module), before) or same(_behaviour(module), expected):
                return "reported"
            return "FAIL: a load that reported missing keys changed the layer"
        if result.missing_keys:
            return "reported" if same(snapshot(module), before) else "FAIL: a load with missing keys changed the layer"
        return "loaded" if same(_behaviour(module), expected) else "FAIL: loaded, but differs from the reference"
    except Exception:  # anything else is the failure under test; report it instead of raising in the worker
        return "FAIL: " + traceback.format_exc(limit=-4)


def _decode(kind: str, state: QuantState) -> torch.Tensor:
    weight = reference(kind)[0].weight
    return F.dequantize_4bit(weight, state) if kind in ("nf4", "fp4-nested") else F.dequantize_blockwise(weight, state)


def run_from_dict(kind: str, packed: bool, mutations: list[tuple]) -> str:
    """``QuantState.from_dict`` on the mutated reference state, then decoding the reference
    weight with it; the outcome (see above)."""
    try:
        expected = reference(kind)[0].dequantize()
        try:
            state = QuantState.from_dict(apply(state_items(kind, packed), mutations))
            decoded = _decode(kind, state).reshape(expected.shape)
        except CLEAN:
            return "refused"
        return "loaded" if same([decoded], [expected]) else "FAIL: decoded, but differs from the reference"
    except Exception:
        return "FAIL: " + traceback.format_exc(limit=-4)


@dataclass
class CheckpointCase:
    """One generated case: ``call`` is ("load", kind, strict, mutations) or ("from_dict", kind, packed, mutations)."""

    op: str
    label: str
    call: tuple


def make_case(seed: int, index: int) -> CheckpointCase:
    """Case ``index`` of campaign ``seed``: loading and from_dict alternate over every kind."""
    rng = random.Random(f"{seed}:{index}")
    kind = rng.choice(sorted(KINDS) if index % 2 else STATE_KINDS)
    if index % 2:
        mutations = draw_mutations(rng, reference(kind)[1])
        call = ("load", kind, rng.random() < 0.5, mutations)
    else:
        packed = rng.random() < 0.7
        call = ("from_dict", kind, packed, draw_mutations(rng, state_items(kind, packed)))
    return CheckpointCase(f"{call[0]} {kind}", describe(call).replace("\n", " "), call)


def run_case(case: CheckpointCase, index: int) -> tuple[str, str]:
    """The campaign's outcome of one case: loaded is "equal", refused or reported is "clean",
    a traceback is "unclean", a changed or wrong layer is "wrong"."""
    what, kind, flag, mutations = case.call
    outcome = run_load(kind, mutations, flag) if what == "load" else run_from_dict(kind, flag, mutations)
    if not outcome.startswith("FAIL"):
        return ("equal" if outcome == "loaded" else "clean"), outcome
    return ("unclean" if "Traceback" in outcome else "wrong"), outcome


def describe(case: tuple) -> str:
    """A case, with long values (tensors, blobs) cut short."""
    text = io.StringIO()
    print(*(repr(part) for part in case[:-1]), file=text)
    for mutation in case[-1]:
        print("  ", tuple(f"{part!r:.60}" for part in mutation), file=text)
    return text.getvalue()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], target="tightfit.quant.fuzz"))
