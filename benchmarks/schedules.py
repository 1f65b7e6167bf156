"""BFS against DFS over slices on an attention-heavy block, measured side by side in one run.

The model is one self-attention block whose core (scores, softmax, weighted sum) is
hinted ``tightfit.hint(schedule=..., slices=N, slice_dim=1)``; batch x heads is large
enough that the attention scores (batch x heads x seq x seq floats) dominate. Every
row is compiled with ``torch.compile(model, backend=tightfit.graph.compiler(...))``:

- region peak: the most bytes of tensors created while the region's split runs (the
  scores, their softmax, the preallocated output). On the CPU a dispatch mode counts
  them, entered and left by the split observer, with splits run as FX modules
  (inductor's generated code allocates outside the dispatcher, where no mode can count
  it); on an accelerator, the allocator's peak over the region, with inductor;
- cut: 1 - region peak / BFS region peak, against the target 0.8 x (N-1)/N;
- run peak: the same over the whole graph. RSS (CPU only): the growth of the
  process's peak resident set during one call (VmHWM after a reset, minus the RSS
  before), with FX and with inductor-compiled splits; glibc's mmap threshold is pinned
  to 64 KiB so that freed blocks go back to the OS and RSS follows live memory;
- latency: the best of ``--repeat`` calls, FX and inductor, the rows taking turns call
  by call so that a busy moment of a shared machine hits them alike ("x bfs": against
  the BFS row).
  Inductor turns the BFS region into fused attention (no scores in memory at all),
  which is why its RSS barely changes with the schedule.

On an accelerator (``--device cuda``) one more row runs the region on the CPU
(``device="cpu"`` hint): a cuda+cpu split, with the bytes copied each way.

Run: python benchmarks/schedules.py [--device cpu|cuda] [--batch B] [--heads H] [--seq S] [--head-dim D] [--repeat R]
"""

from __future__ import annotations

import argparse
import ctypes
import logging
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


class CPUCounter:
    """Bytes of tensors created, per scope, by dispatch modes the split observer enters."""

    def __init__(self) -> None:
        self.region, self.run = LiveTensorBytes(), LiveTensorBytes()

    def observe(self, event, split, first, last) -> None:
        if event == "start":
            if split is first:
                self.run.__enter__()
            if is_region(split):
                self.region.__enter__()
        else:
            if is_region(split):
                self.region.__exit__(None, None, None)  # its ops went on to the run's counter too
            if split is last:
                self.run.__exit__(None, None, None)


class AcceleratorCounter:
    """The allocator's peak over the region and over the whole graph."""

    def __init__(self, device: torch.device) -> None:
        self.module = getattr(torch, device.type)
        self.region = type("Peak", (), {"peak": 0})()
        self.run = type("Peak", (), {"peak": 0})()
        self.run_base = self.region_base = 0

    def observe(self, event, split, first, last) -> None:
        self.module.synchronize()
        if event == "start" and split is first:
            self.run_base = self.module.memory_allocated()
            self.module.reset_peak_memory_stats()
        self.run.peak = max(self.run.peak, self.module.max_memory_allocated() - self.run_base)  # before any reset
        if is_region(split) and event == "start":
            self.region_base = self.module.memory_allocated()
            self.module.reset_peak_memory_stats()
        elif is_region(split):
            self.region.peak = self.module.max_memory_allocated() - self.region_base


def peaks(fn, x, device: torch.device) -> tuple[int, int]:
    """(region peak, whole-run peak) in bytes."""
    ran = []
    with observe_splits(lambda event, split: ran.append(split) if event == "start" else None):
        fn(x)  # learn the first and last split
    counter = CPUCounter() if device.type == "cpu" else AcceleratorCounter(device)
    with observe_splits(lambda event, split: counter.observe(event, split, ran[0], ran[-1])):
        fn(x)
    return counter.region.peak, counter.run.peak


def rss_growth(fn, x) -> int | None:
    before = read_process_memory()[0]
    if x.device.type != "cpu" or before is None or not reset_process_peak():
        return None
    fn(x)
    return read_process_memory()[1] - before


def best_ms(fns, x, repeat: int) -> list[float]:
    """Best time of each of ``fns`` over ``repeat`` rounds in which they take turns."""
    sync = getattr(torch, x.device.type).synchronize if x.device.type != "cpu" else (lambda: None)
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for index, fn in enumerate(fns):
            sync()
            start = time.perf_counter()
            fn(x)
            sync()
            best[index] = min(best[index], time.perf_counter() - start)
    return [seconds * 1e3 for seconds in best]


def _mib_or_na(nbytes: int | None) -> str:
    return f"{nbytes / MiB:>8.0f}" if nbytes is not None else f"{'n/a':>8}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("tightfit.graph").setLevel(logging.ERROR)
    device = torch.device(args.device)
    pinned = pin_mmap_threshold()
    embed = args.heads * args.head_dim
    x = torch.randn(args.batch, args.seq, embed, generator=torch.Generator().manual_seed(0)).to(device)
    scores = args.batch * args.heads * args.seq * args.seq * 4
    where = f"{torch.get_num_threads()} CPU threads" if device.type == "cpu" else f"{device}"
    print(
        f"torch {torch.__version__}, {where}; batch {args.batch} x heads {args.heads} x seq {args.seq} x "
        f"head dim {args.head_dim}; scores {scores / MiB:.0f} MiB; mmap threshold pinned: {pinned}"
    )
    header = (
        f"{'schedule':<14}{'region MiB':>11}{'cut':>7}{'target':>8}{'run MiB':>9}{'RSS fx':>8}{'RSS ind':>9}"
        f"{'fx ms':>8}{'x bfs':>7}{'ind ms':>8}{'x bfs':>7}"
    )
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)
    reference = Attention(embed, args.heads, {"schedule": "bfs"}).to(device)
    with torch.no_grad():
        expected = reference(x)
        eager_rss = rss_growth(reference, x)
    rows = [("bfs", {"schedule": "bfs"})] + [
        (f"dfs {n}", {"schedule": "dfs", "slices": n, "slice_dim": 1}) for n in (2, 4, 8, 16)
    ]
    if device.type != "cpu":
        rows.append(("bfs on cpu", {"schedule": "bfs", "device": "cpu"}))
    torch._dynamo.config.recompile_limit = 64  # every row compiles the same forward twice (FX, inductor)
    measured = []
    for label, hints in rows:
        model = Attention(embed, args.heads, hints).to(device)
        model.load_state_dict(reference.state_dict())
        fx = torch.compile(model, backend=compiler(execution="fx"))
        ind = torch.compile(model, backend=compiler(execution="inductor"))
        with torch.no_grad():
            for fn in (fx, ind):
                torch.testing.assert_close(fn(x), expected, rtol=1e-4, atol=1e-4)
            region, run = peaks(fx if device.type == "cpu" else ind, x, device)
            measured.append((label, hints, fx, ind, region, run, rss_growth(fx, x), rss_growth(ind, x)))
    with torch.no_grad():
        times = best_ms([reference] + [fn for row in measured for fn in row[2:4]], x, args.repeat)
    eager_ms = times[0]
    bfs = {}
    for index, (label, hints, _, _, region, run, rss_fx, rss_ind) in enumerate(measured):
        fx_ms, ind_ms = times[1 + 2 * index], times[2 + 2 * index]
        bfs = bfs or {"region": region, "fx": fx_ms, "ind": ind_ms}
        slices = hints.get("slices", 1)
        cut = 1 - region / bfs["region"]
        target = 0.8 * (slices - 1) / slices
        verdict = "" if slices == 1 or cut >= target else "  MISSES TARGET"
        print(
            f"{label:<14}{region / MiB:>11.1f}{cut:>7.0%}{target:>8.0%}{run / MiB:>9.1f}{_mib_or_na(rss_fx)}{_mib_or_na(rss_ind):>9}"
            f"{fx_ms:>8.1f}{fx_ms / bfs['fx']:>6.2f}x{ind_ms:>8.1f}{ind_ms / bfs['ind']:>6.2f}x{verdict}"
        )
        if "device" in hints:
            head_bytes = 3 * x.numel() * 4 + x.numel() * 4  # q, k, v to the CPU, the output back
            print(
                f"{'':<14}copies per call: {head_bytes / MiB:.1f} MiB across; cost over bfs: {ind_ms - bfs['ind']:+.1f} ms (inductor)"
            )
    eager_rss_text = f", RSS growth {eager_rss / MiB:.0f} MiB" if eager_rss is not None else ""
    print(f"eager (no compile): {eager_ms:.1f} ms{eager_rss_text}")


if __name__ == "__main__":
    main()
