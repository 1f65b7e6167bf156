"""Per-call cost of small op calls: what argument checks and dispatch add where the work is tiny.

Each row times one small call (microseconds; per round the best of 5 batches of 200
calls, then the median over rounds) through the public function, the direct path past
the dispatcher (``tightfit.ops.get_op(name)(...)``), the raw dispatcher entry
(``torch.ops.tightfit.<name>``), and the op's argument check alone (which every path
runs). With ``--against DIR`` the same rows are measured for another checkout of
tightfit (its ``src``) in alternating rounds, one process each, and printed side by
side as this / before.

Run: python benchmarks/call_overhead.py [--rounds 5] [--against /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = (
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_4bit",
    "dequantize_4bit",
    "gemv_4bit",
    "int8_vectorwise_quant",
    "int8_linear_matmul",
    "int8_mm_dequant",
    "cast",
)


def _calls():
    """(row, path) -> a no-argument callable making one small call."""
    import torch

    import tightfit
    from tightfit.ops import get_op

    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(64, 64, generator=g)
    code = tightfit.ops.dynamic_map()
    q8, absmax8 = tightfit.ops.quantize_blockwise(x64, blocksize=64)
    q4, absmax4 = tightfit.ops.quantize_4bit(x64, blocksize=64, quant_type="nf4")
    w = torch.randn(256, 256, generator=g)
    qw, absmaxw = tightfit.ops.quantize_4bit(w, blocksize=64, quant_type="nf4")
    token = torch.randn(1, 256, generator=g)
    ints, ints_w = (
        torch.randint(-127, 128, (1, 64), dtype=torch.int8),
        torch.randint(-127, 128, (64, 64), dtype=torch.int8),
    )
    product = torch.randint(-1000, 1000, (1, 64), dtype=torch.int32)
    rows, cols = torch.rand(1), torch.rand(64)
    f8 = torch.randn(1024, generator=g).to(torch.float8_e4m3fn)
    raw = {
        "quantize_blockwise": (x64, code, 64),
        "dequantize_blockwise": (q8, absmax8, code, 64, torch.float32),
        "quantize_4bit": (x64, 64, "nf4", torch.uint8),
        "dequantize_4bit": (q4, absmax4, 64, "nf4", [64, 64], torch.float32),
        "gemv_4bit": (token, qw, [256, 256], absmaxw, 64, "nf4"),
        "int8_vectorwise_quant": (x64, 0.0),
        "int8_linear_matmul": (ints, ints_w),
        "int8_mm_dequant": (product, rows, cols, torch.float16, None),
        "cast": (f8, torch.bfloat16),
    }
    public = {
        "quantize_blockwise": lambda: tightfit.ops.quantize_blockwise(x64, blocksize=64),
        "dequantize_blockwise": lambda: tightfit.ops.dequantize_blockwise(q8, absmax8, blocksize=64),
        "quantize_4bit": lambda: tightfit.ops.quantize_4bit(x64, blocksize=64, quant_type="nf4"),
        "dequantize_4bit": lambda: tightfit.ops.dequantize_4bit(q4, absmax4, 64, "nf4", (64, 64)),
        "gemv_4bit": lambda: tightfit.ops.gemv_4bit(token, qw, (256, 256), absmaxw, 64, "nf4"),
        "int8_vectorwise_quant": lambda: tightfit.ops.int8_vectorwise_quant(x64),
        "int8_linear_matmul": lambda: tightfit.ops.int8_linear_matmul(ints, ints_w),
        "int8_mm_dequant": lambda: tightfit.ops.int8_mm_dequant(product, rows, cols),
        "cast": lambda: tightfit.ops.cast(f8, torch.bfloat16),
    }
    calls = {}
    for name in ROWS:
        direct, dispatched = get_op(name), getattr(torch.ops.tightfit, name)
        calls[(name, "public")] = public[name]
        calls[(name, "direct")] = lambda op=direct, args=raw[name]: op(*args)
        calls[(name, "torch.ops")] = lambda op=dispatched, args=raw[name]: op(*args)
        if hasattr(direct, "check"):  # the op's own argument check alone (absent from older checkouts)
            calls[(name, "check")] = lambda op=direct, args=raw[name]: op.check(*args)
    return calls


def measure_once(calls: int = 200, batches: int = 5) -> dict[str, float]:
    """One round: microseconds per call for every (row, path), as "row|path" -> us: the best of
    ``batches`` batches of ``calls`` calls, since what is measured is a fixed cost and noise only adds."""
    import torch

    torch.set_num_threads(1)  # small calls: threads only add noise
    result = {}
    for (name, path), fn in _calls().items():
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, time.perf_counter() - start)
        result[f"{name}|{path}"] = best / calls * 1e6
    return result


def _round(src: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another tightfit checkout, measured in alternating rounds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure_once()))
        return
    here = Path(__file__).resolve().parent.parent / "src"
    trees = {"this": here} | ({"before": args.against.resolve() / "src"} if args.against else {})
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
    for _ in range(args.rounds):
        for label, src in trees.items():  # alternate, so drift on a shared machine hits both alike
            rounds[label].append(_round(src))
    keys = list(rounds["this"][0])
    medians = {
        label: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for label, runs in rounds.items()
    }
    spread = max(max(r[key] for r in rounds["this"]) / min(r[key] for r in rounds["this"]) for key in keys)
    print(
        f"us per call, 1 thread: median over {args.rounds} rounds of the best of 5 batches of 200 calls; "
        f"largest max/min across rounds: {spread:.2f}"
    )
    header = f"{'op':<22} {'path':<10} {'this':>8}"
    print(header + (f" {'before':>8} {'this/before':>12}" if args.against else ""))
    for key in keys:
        name, path = key.split("|")
        line = f"{name:<22} {path:<10} {medians['this'][key]:8.1f}"
        if args.against and key in medians["before"]:
            line += f" {medians['before'][key]:8.1f} {medians['this'][key] / medians['before'][key]:12.2f}"
        print(line)


if __name__ == "__main__":
    main()
