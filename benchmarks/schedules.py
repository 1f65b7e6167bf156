"""BFS against DFS over slices on an attention-heavy block, measured side by side in one run.

The model is one self-attention block whose core (scores, softmax, weighted sum) is
hinted ``tightfit.hint(schedule=..., slices=N, slice_dim=1)``; batch x heads is large
enough that the attention scores (batch x heads x seq x seq floats) dominate. Every
row is compiled with ``torch.compile(model, backend=tightfit.graph.compiler(...))``:

- region peak: the most bytes of tensors created while the region's split runs
  (the scores, their softmax, the preallocated output), counted by a dispatch mode
  that the split observer enters and leaves; splits run as FX modules here, because
  inductor's generated code allocates outside the dispatcher where no mode can count it;
- cut: 1 - region peak / BFS region peak, against the target 0.8 x (N-1)/N;
- run peak: the same count over the whole graph (FX); RSS: the growth of the process's
  peak resident set during one call (VmHWM after a reset, minus the RSS before), for
  FX and for inductor-compiled splits. glibc's mmap threshold is pinned to 64 KiB so
  that freed blocks go back to the OS and RSS follows live memory;
- latency: median of ``--repeat`` calls, FX and inductor ("x bfs": against the BFS row).
  Inductor turns the BFS region into fused attention (no scores in memory at all),
  which is why its RSS barely changes with the schedule.

Run: python benchmarks/schedules.py [--batch B] [--heads H] [--seq S] [--head-dim D] [--repeat R]
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import statistics
import time
import warnings

import torch

import tightfit
from tightfit.backends.cpu import read_process_memory, reset_process_peak
from tightfit.graph import compiler, observe_splits
from tightfit.memory import LiveTensorBytes

MiB = 1 << 20


class Attention(torch.nn.Module):
    def __init__(self, embed: int, heads: int, hints: dict) -> None:
        super().__init__()
        self.heads = heads
        self.hints = hints
        self.qkv = torch.nn.Linear(embed, 3 * embed)
        self.out = torch.nn.Linear(embed, embed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embed = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, embed // self.heads).permute(2, 0, 3, 1, 4)
        with tightfit.hint(**self.hints):
            scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
            y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(batch, seq, embed))


def pin_mmap_threshold() -> bool:
    """glibc: serve blocks >= 64 KiB by mmap, so that RSS drops when tensors are freed."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024) == 1  # M_MMAP_THRESHOLD
    except OSError:
        return False


def is_region(split) -> bool:
    return any(node.name.startswith("_softmax") for node in split.nodes)


def counted_peaks(fn, x) -> tuple[int, int]:
    """(region peak, whole-run peak) in bytes created, with a tracker per scope."""
    region, run = LiveTensorBytes(), LiveTensorBytes()
    state = {"splits": 0}

    def observe(event, split):
        if event == "start":
            if state["splits"] == 0:
                run.__enter__()
            state["splits"] += 1
            if is_region(split):
                region.__enter__()
        else:
            if is_region(split):
                region.__exit__(None, None, None)  # its ops went on to the run's tracker too
            if split is last[0]:
                run.__exit__(None, None, None)

    last = [None]
    with observe_splits(lambda event, split: last.__setitem__(0, split) if event == "start" else None):
        fn(x)  # learn the last split
    with observe_splits(observe):
        fn(x)
    return region.peak, run.peak


def rss_growth(fn, x) -> int | None:
    before = read_process_memory()[0]
    if before is None or not reset_process_peak():
        return None
    fn(x)
    return read_process_memory()[1] - before


def latency_ms(fn, x, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("tightfit.graph").setLevel(logging.ERROR)
    pinned = pin_mmap_threshold()
    embed = args.heads * args.head_dim
    x = torch.randn(args.batch, args.seq, embed, generator=torch.Generator().manual_seed(0))
    scores = args.batch * args.heads * args.seq * args.seq * 4
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; batch {args.batch} x heads {args.heads} x "
          f"seq {args.seq} x head dim {args.head_dim}; scores {scores / MiB:.0f} MiB; mmap threshold pinned: {pinned}")
    configs = [("bfs", None)] + [("dfs", n) for n in (2, 4, 8, 16)]
    header = (f"{'schedule':<10}{'region MiB':>11}{'cut':>7}{'target':>8}{'run MiB':>9}{'RSS fx':>8}{'RSS ind':>9}"
              f"{'fx ms':>8}{'x bfs':>7}{'ind ms':>8}{'x bfs':>7}")
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)
    reference = Attention(embed, args.heads, {"schedule": "bfs"})
    with torch.no_grad():
        expected = reference(x)
        eager_ms = latency_ms(reference, x, args.repeat)
        eager_rss = rss_growth(reference, x)
    bfs_region = bfs_fx = bfs_ind = None
    torch._dynamo.config.recompile_limit = 64  # every row compiles the same forward twice (FX, inductor)
    for schedule, slices in configs:
        hints = {"schedule": schedule} if slices is None else {"schedule": schedule, "slices": slices, "slice_dim": 1}
        model = Attention(embed, args.heads, hints)
        model.load_state_dict(reference.state_dict())
        fx = torch.compile(model, backend=compiler(execution="fx"))
        ind = torch.compile(model, backend=compiler(execution="inductor"))
        with torch.no_grad():
            for fn in (fx, ind):
                torch.testing.assert_close(fn(x), expected, rtol=1e-4, atol=1e-4)
            region, run = counted_peaks(fx, x)
            rss_fx, rss_ind = rss_growth(fx, x), rss_growth(ind, x)
            fx_ms, ind_ms = latency_ms(fx, x, args.repeat), latency_ms(ind, x, args.repeat)
        if slices is None:
            bfs_region, bfs_fx, bfs_ind = region, fx_ms, ind_ms
        cut = 1 - region / bfs_region
        target = 0.8 * (slices - 1) / slices if slices else 0.0
        label = "bfs" if slices is None else f"dfs {slices}"
        rss = lambda value: f"{value / MiB:>8.0f}" if value is not None else f"{'n/a':>8}"
        print(f"{label:<10}{region / MiB:>11.1f}{cut:>7.0%}{target:>8.0%}{run / MiB:>9.1f}{rss(rss_fx)}{rss(rss_ind):>9}"
              f"{fx_ms:>8.1f}{fx_ms / bfs_fx:>6.2f}x{ind_ms:>8.1f}{ind_ms / bfs_ind:>6.2f}x" + ("" if slices is None or cut >= target else "  MISSES TARGET"))
    print(f"eager (no compile): {eager_ms:.1f} ms, RSS growth {eager_rss / MiB if eager_rss is not None else float('nan'):.0f} MiB")


if __name__ == "__main__":
    main()
