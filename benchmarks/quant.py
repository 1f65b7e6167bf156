"""Blockwise quantization on this machine: tightfit against bitsandbytes (when installed)
on the same tensors, and a copy of the same number of bytes as the bandwidth roof,
measured side by side in one run.

Each figure is in milliseconds: on the CPU the best of ``--repeat`` runs; on an
accelerator the median over ``--repeat`` device-timed rounds of 10 calls each. "x bnb" is
bitsandbytes' time over tightfit's; "of copy" is the copy's time over tightfit's
(100% = memory speed). The int8 rows (LLM.int8()'s ops) are timed differently on the CPU,
where they are compute-bound and a shared machine's load drifts: tightfit, bitsandbytes
and the copy run in turn, round after round, and each figure is the median of its rounds.

Run: python benchmarks/quant.py [--device cuda] [--numel N] [--repeat R] [--only int8|blockwise]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

import tightfit.ops as ops
import tightfit.quant.functional as quant

try:
    import bitsandbytes as bnb_root
    import bitsandbytes.functional as bnb
except ImportError:  # the comparison is optional; tightfit's own figures still print
    bnb = bnb_root = None


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def device_ms(fn, repeat: int, device: torch.device, calls: int = 10) -> float:
    """Median per-call time over ``repeat`` rounds, timed with device events."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(repeat):
        start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / calls)
    return statistics.median(rounds)


def alternating_ms(fns, repeat: int) -> list[float]:
    """Median ms of each of ``fns``, run in turn each round so that load drifts hit all alike."""
    for fn in fns:
        fn()
    rounds = [[] for _ in fns]
    for _ in range(repeat):
        for fn, times in zip(fns, rounds, strict=True):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) * 1e3 for times in rounds]


def copy_ms(nbytes: int, timer) -> float:
    source = torch.ones(max(nbytes // 2, 1), dtype=torch.uint8, device=DEVICE)  # read half, write half
    target = torch.empty_like(source)
    return timer(lambda: target.copy_(source))


DEVICE = torch.device("cpu")
ROWS: list[dict] = []  # every printed row, for --json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (default cpu)")
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=("int8", "blockwise"), help="one group of rows (default both)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    global DEVICE
    DEVICE = torch.device(args.device)
    n = args.numel
    if DEVICE.type == "cpu":
        timer = functools.partial(best_ms, repeat=args.repeat)
        where = f"{torch.get_num_threads()} CPU threads"
    else:
        timer = functools.partial(device_ms, repeat=args.repeat, device=DEVICE)
        where = torch.accelerator.current_accelerator().type + " " + getattr(torch, DEVICE.type).get_device_name()
    header_line = f"torch {torch.__version__}, {where}, {n:,} elements, bitsandbytes: {bnb_root.__version__ if bnb else 'not installed'}"
    print(header_line)
    header = f"{'op':<40}{'tightfit ms':>12}{'bnb ms':>10}{'copy ms':>10}{'x bnb':>8}{'of copy':>9}"
    print(header)
    print("-" * len(header))
    if args.only != "int8":
        blockwise_rows(n, timer)
    if args.only != "blockwise":
        int8_rows(timer, args.repeat)
    if args.json:
        args.json.write_text(json.dumps({"header": header_line, "rows": ROWS}, indent=1))


def blockwise_rows(n: int, timer) -> None:
    if bnb:  # built once: making them is slower than some of the ops timed
        dynamic, nf4 = bnb.create_dynamic_map().to(DEVICE), bnb.get_4bit_type("nf4", DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        A = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
        size = A.element_size()
        q8, absmax8 = ops.quantize_blockwise(A)
        q4, absmax4 = ops.quantize_4bit(A, 64, "nf4")
        rows = [
            (
                f"quantize_blockwise {dtype}",
                n * size + n,
                lambda: ops.quantize_blockwise(A),
                (lambda: bnb.quantize_blockwise(A)) if bnb else None,
            ),
            (
                f"dequantize_blockwise -> {dtype}",
                n + n * size,
                lambda: ops.dequantize_blockwise(q8, absmax8, dtype=dtype),
                (
                    lambda: bnb.dequantize_blockwise(
                        q8, bnb.QuantState(absmax=absmax8, code=dynamic, blocksize=4096, dtype=dtype)
                    )
                )
                if bnb
                else None,
            ),
            (
                f"quantize_4bit nf4 bs64 {dtype}",
                n * size + n // 2,
                lambda: ops.quantize_4bit(A, 64, "nf4"),
                (lambda: bnb.quantize_4bit(A, blocksize=64, quant_type="nf4")) if bnb else None,
            ),
            (
                f"dequantize_4bit nf4 bs64 -> {dtype}",
                n // 2 + n * size,
                lambda: ops.dequantize_4bit(q4, absmax4, 64, "nf4", [n], dtype),
                (
                    lambda: bnb.dequantize_4bit(
                        q4,
                        bnb.QuantState(
                            absmax=absmax4, shape=A.shape, code=nf4, blocksize=64, quant_type="nf4", dtype=dtype
                        ),
                    )
                )
                if bnb
                else None,
            ),
        ]
        if dtype == torch.bfloat16:
            side = 4096
            W = torch.randn(side, side, generator=torch.Generator().manual_seed(1)).to(DEVICE)
            packed, state = quant.quantize_4bit(W, quant_type="nf4")
            x = torch.randn(1, side).to(DEVICE, dtype)
            rows.append(
                (
                    f"matmul_4bit 1x{side} @ nf4 {side}x{side} {dtype}",
                    side * side // 2,
                    lambda: quant.matmul_4bit(x, packed, state),
                    (
                        lambda: bnb_root.matmul_4bit(
                            x,
                            packed.t(),
                            bnb.QuantState(
                                absmax=state.absmax,
                                shape=W.shape,
                                code=nf4,
                                blocksize=64,
                                quant_type="nf4",
                                dtype=torch.float32,
                            ),
                        )
                    )
                    if bnb
                    else None,
                )
            )
        for name, nbytes, ours, theirs in rows:
            ours_ms = timer(ours)
            theirs_ms = timer(theirs) if theirs else float("nan")
            print_row(name, ours_ms, theirs_ms, copy_ms(nbytes, timer))


def print_row(name: str, ours_ms: float, theirs_ms: float, roof_ms: float) -> None:
    ROWS.append(
        {
            "op": name,
            "tightfit_ms": ours_ms,
            "bnb_ms": theirs_ms if theirs_ms == theirs_ms else None,
            "copy_ms": roof_ms,
        }
    )
    print(
        f"{name:<40}{ours_ms:>12.2f}{theirs_ms:>10.2f}{roof_ms:>10.2f}{theirs_ms / ours_ms:>7.2f}x{roof_ms / ours_ms:>9.0%}"
    )


def int8_rows(timer, repeat: int) -> None:
    """LLM.int8()'s ops on row-wise quantized normal data: the matmul at issue 15's shapes
    (A rows x K @ B N x K), one decoding token and a batch at width 4096; quantizing the
    input and dequantizing the product at the first shape."""
    generator = torch.Generator().manual_seed(2)

    def quantized(rows: int, cols: int) -> torch.Tensor:
        return ops.int8_vectorwise_quant(torch.randn(rows, cols, generator=generator).to(DEVICE))[0]

    rows = []
    for M, K, N in ((1024, 512, 512), (4096, 499, 512), (1, 4096, 4096), (64, 4096, 4096)):
        A, B = quantized(M, K), quantized(N, K)
        rows.append(
            (
                f"int8_linear_matmul {M}x{K} @ {N}x{K}",
                M * K + N * K + 4 * M * N,
                functools.partial(ops.int8_linear_matmul, A, B),
                functools.partial(bnb.int8_linear_matmul, A, B) if bnb else None,
            )
        )
    M, N = 1024, 512
    x_dtype = torch.float32 if DEVICE.type == "cpu" else torch.float16  # bitsandbytes' CUDA kernel takes float16 only
    X = torch.randn(M, N, generator=generator).to(DEVICE, x_dtype)
    product = torch.randint(-(1 << 20), 1 << 20, (M, N), generator=generator, dtype=torch.int32).to(DEVICE)
    row_stats, col_stats = torch.rand(M).to(DEVICE), torch.rand(N).to(DEVICE)
    rows += [
        (
            f"int8_vectorwise_quant {M}x{N} {str(x_dtype).removeprefix('torch.')}",
            (X.element_size() + 1) * M * N,
            functools.partial(ops.int8_vectorwise_quant, X),
            functools.partial(bnb.int8_vectorwise_quant, X) if bnb else None,
        ),
        (
            f"int8_mm_dequant {M}x{N} -> float16",
            6 * M * N,
            functools.partial(ops.int8_mm_dequant, product, row_stats, col_stats),
            functools.partial(bnb.int8_mm_dequant, product, row_stats, col_stats) if bnb else None,
        ),
    ]
    for name, nbytes, ours, theirs in rows:
        source = torch.ones(max(nbytes // 2, 1), dtype=torch.uint8, device=DEVICE)
        target = torch.empty_like(source)
        fns = [ours, functools.partial(target.copy_, source)] + ([theirs] if theirs else [])
        if DEVICE.type == "cpu":
            times = alternating_ms(fns, max(repeat, 15))
        else:
            times = [timer(fn) for fn in fns]
        print_row(name, times[0], times[2] if theirs else float("nan"), times[1])


if __name__ == "__main__":
    main()
