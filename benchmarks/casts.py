"""Float8 storage casts on this machine: tightfit against torch's own cast and against a
copy of the same number of bytes, measured side by side in one run.

GB/s counts bytes read plus bytes written. Two settings, because they differ a lot on
the CPU: "alloc" returns a new tensor (``cast(x, dtype)`` vs ``x.to(dtype)``), where the
first touch of fresh pages costs as much as the cast itself; tightfit backs large
results with huge pages, so its copy roof here is a copy into a fresh buffer allocated
the same way (``clone`` with 4 KiB pages is shown too). "out" writes into a buffer
that already exists (``cast(x, dtype, out=buf)`` vs ``buf.copy_(x)``, copy =
``copy_``), which is how layerwise casting uses it.

Run: python benchmarks/casts.py [--numel N] [--repeat R]
"""

from __future__ import annotations

import argparse
import time

import torch

import tightfit
from tightfit.ops._hugepages import empty_with_huge_pages

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
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.numel:,} elements; GB/s = (read + written) / time"
    )
    header = f"{'direction':<28}{'mode':<7}{'tightfit':>10}{'torch':>10}{'copy':>10}{'clone':>10}{'x torch':>9}{'of copy':>9}"
    print(header)
    print("-" * len(header))
    pairs = [(s, t) for s in FLOAT8 for t in WIDE] + [(s, t) for s in WIDE for t in FLOAT8]
    for src_dtype, dst_dtype in pairs:
        x = source(src_dtype, args.numel)
        moved = args.numel * (x.element_size() + torch.empty((), dtype=dst_dtype).element_size())
        expected = x.to(dst_dtype)
        got = tightfit.ops.cast(x, dst_dtype)
        if not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
            raise SystemExit(f"{src_dtype} -> {dst_dtype}: tightfit differs from torch")
        del got, expected
        same_bytes = torch.ones(moved // 2, dtype=torch.uint8)
        buffer = torch.empty(args.numel, dtype=dst_dtype)
        copy_target = torch.empty_like(same_bytes)
        modes = {
            "alloc": (
                lambda: tightfit.ops.cast(x, dst_dtype),
                lambda: x.to(dst_dtype),
                lambda: empty_with_huge_pages(same_bytes.shape, torch.uint8).copy_(same_bytes),
                lambda: same_bytes.clone(),
            ),
            "out": (
                lambda: tightfit.ops.cast(x, dst_dtype, out=buffer),
                lambda: buffer.copy_(x),
                lambda: copy_target.copy_(same_bytes),
                None,
            ),
        }
        name = f"{str(src_dtype)[6:]} -> {str(dst_dtype)[6:]}"
        for mode, (ours, theirs, copy, clone) in modes.items():
            rates = [moved / best_seconds(fn, args.repeat) / 1e9 for fn in (ours, theirs, copy)]
            clone_rate = f"{moved / best_seconds(clone, args.repeat) / 1e9:>10.2f}" if clone else f"{'':>10}"
            print(
                f"{name:<28}{mode:<7}{rates[0]:>10.2f}{rates[1]:>10.2f}{rates[2]:>10.2f}{clone_rate}{rates[0] / rates[1]:>8.1f}x{rates[0] / rates[2]:>8.0%}"
            )


if __name__ == "__main__":
    main()
