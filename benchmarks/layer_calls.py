"""Per call on a device: what one quantized layer's one-token forward costs the host and
the device, and where the host's time goes. Decoding a 1.1B model eagerly is about 150
such calls a token; on a GPU their host time, not the weights' bytes, sets the speed.

Each layer is the 1.1B model's FFN shape (5632 x 2048) at one token: nf4 and 8-bit
blockwise (tightfit's quantized layers), float8 storage (layerwise casting), and bf16
``nn.Linear`` as the floor. Per layer: the host's microseconds per call (calls issued
without waiting, so the host's own cost where it is the slower side), the wall time per
call once the device is waited for, the device's time per call (CUDA events), whether the
layer took its bound kernel (the direct path), and the functions that took the most host
time per call (``cProfile`` over the same calls).

Run: python benchmarks/layer_calls.py --device cuda --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch
from _common import markdown_table
from torch import nn

from tightfit.hooks import apply_layerwise_casting
from tightfit.ops._direct import binding_of
from tightfit.quant.modules import Linear4bit, Linear8bit

SHAPE = {"1b": (5632, 2048), "tiny": (256, 128)}


def layers(shape: tuple[int, int], device: torch.device) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    base = nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16)
    cast = nn.Sequential(nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16))
    apply_layerwise_casting(cast, torch.float8_e4m3fn, torch.bfloat16)
    return {
        "bf16 nn.Linear": base.to(device),
        "nf4": Linear4bit.from_linear(base).to(device),
        "8bit": Linear8bit.from_linear(base).to(device),
        "float8 storage": cast.to(device),
    }


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _top(profile: cProfile.Profile, calls: int, count: int = 6) -> list[str]:
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [
        f"{name} ({Path(file).name}:{line}) {total / calls * 1e6:.1f} us"
        for (file, line, name), (*_, total, _c, _) in rows
    ]


def measure(layer: nn.Module, x: torch.Tensor, calls: int) -> dict:
    device = x.device
    with torch.inference_mode():
        for _ in range(20):
            layer(x)
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            layer(x)
        issued = time.perf_counter()
        _sync(device)
        done = time.perf_counter()
        device_ms = None
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                layer(x)
            end.record()
            end.synchronize()
            device_ms = begin.elapsed_time(end) / calls
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            layer(x)
        profile.disable()
        _sync(device)
    target = layer[0] if isinstance(layer, nn.Sequential) else layer
    bound = "_tightfit_binding" in target.__dict__ and binding_of(target).bound is not None
    return {
        "host_us_per_call": (issued - start) / calls * 1e6,
        "wall_us_per_call": (done - start) / calls * 1e6,
        "device_us_per_call": None if device_ms is None else device_ms * 1e3,
        "direct_path": bound,
        "top_host_functions": _top(profile, calls),
    }


def report(rows: dict[str, dict], header: dict) -> str:
    table = [
        [
            name,
            f"{row['host_us_per_call']:.1f}",
            f"{row['wall_us_per_call']:.1f}",
            "-" if row["device_us_per_call"] is None else f"{row['device_us_per_call']:.1f}",
            "yes" if row["direct_path"] else "no",
        ]
        for name, row in rows.items()
    ]
    lines = [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", markdown_table(["layer", "host us/call", "wall us/call", "device us/call", "direct path"], table)]
    for name, row in rows.items():
        lines += ["", f"{name}, the host's most costly functions per call (cProfile, total time):"]
        lines += [f"- {entry}" for entry in row["top_host_functions"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=sorted(SHAPE), default=None, help="default: 1b on an accelerator, else tiny")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    size = args.size or ("tiny" if device.type == "cpu" else "1b")
    shape = SHAPE[size]
    header = {"device": str(device), "torch": torch.__version__, "shape": f"{shape[0]} x {shape[1]}, one token, bf16"}
    x = torch.randn(1, 1, shape[1], dtype=torch.bfloat16, device=device)
    rows = {name: measure(layer, x, args.calls) for name, layer in layers(shape, device).items()}
    text = report(rows, header)
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
