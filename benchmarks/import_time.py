"""How long ``import tightfit`` takes on top of ``import torch``, in fresh processes.

Each round starts two processes in alternation: one imports torch alone, one imports torch
and then tightfit, each timing its own imports. Prints the medians over rounds, tightfit's
own share (the difference), and how much the rounds varied (min-max), since a shared
machine is noisy. The test suite asserts what the import touches, never how long it takes.

Run: python benchmarks/import_time.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

PROBE = """
import time
start = time.perf_counter()
import torch
torch_done = time.perf_counter()
{second}
print(torch_done - start, time.perf_counter() - torch_done)
"""


def _time(second: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(second=second)], capture_output=True, text=True, check=True
    )
    torch_seconds, rest = (float(word) for word in out.stdout.split())
    return torch_seconds, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds
    torch_alone, tightfit_after_torch = [], []
    for _ in range(rounds):
        torch_alone.append(_time("")[0])
        tightfit_after_torch.append(_time("import tightfit")[1])
    for name, values in (("import torch", torch_alone), ("import tightfit (after torch)", tightfit_after_torch)):
        print(
            f"{name:32s} median {statistics.median(values) * 1000:7.1f} ms"
            f"  (min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f}, {rounds} rounds)"
        )
    share = statistics.median(tightfit_after_torch) / statistics.median(torch_alone)
    print(f"tightfit's import is {share:.2f}x torch's own")


if __name__ == "__main__":
    main()
