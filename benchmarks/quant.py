"""Blockwise quantization on this machine: tightfit against bitsandbytes (when installed)
on the same tensors, and a copy of the same number of bytes as the bandwidth roof,
measured side by side in one run.

Each figure is the best of ``--repeat`` runs in milliseconds; "x bnb" is bitsandbytes'
time over tightfit's; "of copy" is the copy's time over tightfit's (1.0 = memory speed).

Run: python benchmarks/quant.py [--numel N] [--repeat R]
"""

from __future__ import annotations

import argparse
import time
import warnings

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


def copy_ms(nbytes: int, repeat: int) -> float:
    source = torch.ones(max(nbytes // 2, 1), dtype=torch.uint8)  # read half, write half
    target = torch.empty_like(source)
    return best_ms(lambda: target.copy_(source), repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    n = args.numel
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {n:,} elements, bitsandbytes: {'yes' if bnb else 'not installed'}")
    header = f"{'op':<40}{'tightfit ms':>12}{'bnb ms':>10}{'copy ms':>10}{'x bnb':>8}{'of copy':>9}"
    print(header)
    print("-" * len(header))
    for dtype in (torch.float32, torch.bfloat16):
        A = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)
        size = A.element_size()
        q8, absmax8 = ops.quantize_blockwise(A)
        q4, absmax4 = ops.quantize_4bit(A, 64, "nf4")
        if bnb:  # built once, as tightfit's cached maps are: only the kernels are timed
            dynamic, nf4 = bnb.create_dynamic_map(), bnb.get_4bit_type("nf4", "cpu")
        rows = [
            (f"quantize_blockwise {dtype}", n * size + n, lambda: ops.quantize_blockwise(A),
             (lambda: bnb.quantize_blockwise(A)) if bnb else None),
            (f"dequantize_blockwise -> {dtype}", n + n * size, lambda: ops.dequantize_blockwise(q8, absmax8, dtype=dtype),
             (lambda: bnb.dequantize_blockwise(q8, bnb.QuantState(absmax=absmax8, code=dynamic, blocksize=4096, dtype=dtype))) if bnb else None),
            (f"quantize_4bit nf4 bs64 {dtype}", n * size + n // 2, lambda: ops.quantize_4bit(A, 64, "nf4"),
             (lambda: bnb.quantize_4bit(A, blocksize=64, quant_type="nf4")) if bnb else None),
            (f"dequantize_4bit nf4 bs64 -> {dtype}", n // 2 + n * size, lambda: ops.dequantize_4bit(q4, absmax4, 64, "nf4", [n], dtype),
             (lambda: bnb.dequantize_4bit(q4, bnb.QuantState(absmax=absmax4, shape=A.shape, code=nf4, blocksize=64, quant_type="nf4", dtype=dtype))) if bnb else None),
        ]
        if dtype == torch.bfloat16:
            side = 4096
            W = torch.randn(side, side, generator=torch.Generator().manual_seed(1))
            packed, state = quant.quantize_4bit(W, quant_type="nf4")
            x = torch.randn(1, side).to(dtype)
            rows.append((f"matmul_4bit 1x{side} @ nf4 {side}x{side} {dtype}", side * side // 2, lambda: quant.matmul_4bit(x, packed, state),
                         (lambda: bnb_root.matmul_4bit(x, packed.t(), bnb.QuantState(absmax=state.absmax, shape=W.shape, code=nf4, blocksize=64, quant_type="nf4", dtype=torch.float32))) if bnb else None))
        for name, nbytes, ours, theirs in rows:
            ours_ms = best_ms(ours, args.repeat)
            theirs_ms = best_ms(theirs, args.repeat) if theirs else float("nan")
            roof_ms = copy_ms(nbytes, args.repeat)
            print(f"{name:<40}{ours_ms:>12.2f}{theirs_ms:>10.2f}{roof_ms:>10.2f}{theirs_ms / ours_ms:>7.1f}x{roof_ms / ours_ms:>9.0%}")


if __name__ == "__main__":
    main()
