"""Float8 storage casts on this machine: tightfit against torch's own cast and against a
copy of the same number of bytes, measured side by side in one run.

GB/s counts bytes read plus bytes written. Two settings, because they differ a lot on
the CPU: "alloc" returns a new tensor (``cast(x, dtype)`` vs ``x.to(dtype)``, copy =
``clone``), where the first touch of fresh pages costs as much as the cast; "out"
writes into a buffer that already exists (``cast(x, dtype, out=buf)`` vs
``buf.copy_(x)``, copy = ``copy_``), which is how layerwise casting uses it.

Run: python benchmarks/casts.py [--numel N] [--repeat R]
"""

from __future__ import annotations

import argparse
import time

import torch

import tightfit

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
WIDE = [torch.bfloat16, torch.float16, torch.float32]


def best_seconds(fn, repeat: int) -> float:
    fn()  # warm: compile kernels, fault in pages of reused buffers
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def source(dtype: torch.dtype, numel: int) -> torch.Tensor:
    return (torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.numel:,} elements; GB/s = (read + written) / time")
    header = f"{'direction':<28}{'mode':<7}{'tightfit':>10}{'torch':>10}{'copy':>10}{'x torch':>9}{'of copy':>9}"
    print(header)
    print("-" * len(header))
    pairs = [(s, t) for s in FLOAT8 for t in WIDE] + [(s, t) for s in WIDE for t in FLOAT8]
    for src_dtype, dst_dtype in pairs:
        x = source(src_dtype, args.numel)
        moved = args.numel * (x.element_size() + torch.empty((), dtype=dst_dtype).element_size())
        expected = x.to(dst_dtype)
        got = tightfit.ops.cast(x, dst_dtype)
        if not torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                           expected.view(torch.uint8) if got.element_size() == 1 else expected.view(torch.int16 if got.element_size() == 2 else torch.int32)):
            raise SystemExit(f"{src_dtype} -> {dst_dtype}: tightfit differs from torch")
        del got, expected
        same_bytes = torch.ones(moved // 2, dtype=torch.uint8)
        buffer = torch.empty(args.numel, dtype=dst_dtype)
        copy_target = torch.empty_like(same_bytes)
        modes = {
            "alloc": (lambda: tightfit.ops.cast(x, dst_dtype), lambda: x.to(dst_dtype), lambda: same_bytes.clone()),
            "out": (lambda: tightfit.ops.cast(x, dst_dtype, out=buffer), lambda: buffer.copy_(x), lambda: copy_target.copy_(same_bytes)),
        }
        name = f"{str(src_dtype)[6:]} -> {str(dst_dtype)[6:]}"
        for mode, (ours, theirs, copy) in modes.items():
            rates = [moved / best_seconds(fn, args.repeat) / 1e9 for fn in (ours, theirs, copy)]
            print(f"{name:<28}{mode:<7}{rates[0]:>10.2f}{rates[1]:>10.2f}{rates[2]:>10.2f}{rates[0] / rates[1]:>8.1f}x{rates[0] / rates[2]:>8.0%}")


if __name__ == "__main__":
    main()
