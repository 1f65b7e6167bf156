"""The 8-bit optimizers' step on this CPU: tightfit.optim against bitsandbytes' CPU kernels
(its own optimizers, on the same parameters) and against torch.optim's 32-bit forms
(``foreach`` and ``fused`` where torch has them), with each one's state bytes and its
share of the machine's bandwidth.

One parameter of N float32 values per optimizer (16M and 128M by default), one gradient
shared by all. Rounds alternate the implementations (one step each, in a shuffled order
per round) so that a slow spell on a shared machine hits all alike; the figures are
medians over rounds, with the spread (min-max over the median). The roof is the machine's
bandwidth for an in-place update (:class:`UpdateRoof`), measured between rounds in the
same run; a step's share of it is the bytes the step must read and write (parameter,
gradient, states; 8-bit: codes and scales) over its time, against that roof.

On a GPU (``--device cuda``) the same rows run there: bitsandbytes' CUDA kernels, tightfit's
Triton kernels, torch's CUDA forms, each step timed to a synchronize; bitsandbytes' rows are
left out where it is not installed.

Run: python benchmarks/optim.py [--device cpu|cuda] [--sizes 16M 128M] [--rounds 5] [--out benchmarks/results/optim.md]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_lines, markdown_table, spread  # noqa: E402

import tightfit.optim as tightfit_optim  # noqa: E402

MIB = 1 << 20


def _bnb():
    """bitsandbytes' optimizers, or None where it is not installed (a GPU machine may lack it)."""
    try:
        import bitsandbytes
    except ImportError:
        return None
    return bitsandbytes.optim


#: rule -> (tightfit 8-bit, bitsandbytes 8-bit, torch 32-bit forms {label: factory}, states)
def _rules() -> dict[str, tuple]:
    bnb = _bnb()  # read only by its rows' factories, which run only where it is installed
    return {
        "Adam": (
            lambda p: tightfit_optim.Adam(p),
            lambda p: bnb.Adam8bit(p),
            {
                "torch Adam foreach": lambda p: torch.optim.Adam(p, foreach=True),
                "torch Adam fused": lambda p: torch.optim.Adam(p, fused=True),
            },
            2,
        ),
        "AdEMAMix": (lambda p: tightfit_optim.AdEMAMix(p), lambda p: bnb.AdEMAMix8bit(p), {}, 3),
        "Lion": (lambda p: tightfit_optim.Lion(p), lambda p: bnb.Lion8bit(p), {}, 1),
        "SGD momentum": (
            lambda p: tightfit_optim.SGD(p, 0.01, 0.9),
            lambda p: bnb.SGD8bit(p, 0.01, 0.9),
            {
                "torch SGD foreach": lambda p: torch.optim.SGD(p, 0.01, 0.9, foreach=True),
                "torch SGD fused": lambda p: torch.optim.SGD(p, 0.01, 0.9, fused=True),
            },
            1,
        ),
        "RMSprop": (
            lambda p: tightfit_optim.RMSprop(p, 0.01),
            lambda p: bnb.RMSprop8bit(p, 0.01),
            {"torch RMSprop foreach": lambda p: torch.optim.RMSprop(p, 0.01, foreach=True)},
            1,
        ),
        "Adagrad": (
            lambda p: tightfit_optim.Adagrad(p),
            lambda p: bnb.Adagrad8bit(p),
            {
                "torch Adagrad foreach": lambda p: torch.optim.Adagrad(p, foreach=True),
                "torch Adagrad fused": lambda p: torch.optim.Adagrad(p, fused=True),
            },
            1,
        ),
    }


class UpdateRoof:
    """The machine's bandwidth for an in-place update, the access pattern of an optimizer
    step: ``a.add_(b)`` over two 256 MiB float32 buffers, counted as the bytes it must
    move (read a and b, write a). A plain copy (``dst.copy_(src)``) understates it: its
    destination is also read into cache before it is written."""

    def __init__(self, device: torch.device, nbytes: int = 256 * MIB) -> None:
        self.a = torch.ones(nbytes // 4, device=device)
        self.b = torch.ones(nbytes // 4, device=device)
        self.samples: list[float] = []

    def measure(self) -> None:
        self.a.add_(self.b)
        times = []
        for _ in range(3):
            _synchronize(self.a.device)
            start = time.perf_counter()
            self.a.add_(self.b)
            _synchronize(self.a.device)
            times.append(time.perf_counter() - start)
        self.samples.append(3 * self.a.numel() * 4 / statistics.median(times))

    @property
    def bandwidth(self) -> float:
        return statistics.median(self.samples)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )


def _moved_bytes(numel: int, states: int, eight_bit: bool) -> int:
    """Bytes one step must read and write: parameter (read, write), gradient (read), each
    state (read, write; 8-bit: a byte a value and a float32 scale per 256)."""
    per_state = numel + 4 * -(-numel // 256) if eight_bit else 4 * numel
    return 4 * numel * 3 + 2 * states * per_state


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def _step_time(optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    _synchronize(device)
    return time.perf_counter() - start


def run_size(numel: int, rounds: int, roof: UpdateRoof, only: list[str] | None, device: torch.device) -> list[dict]:
    grad = torch.randn(numel, device=device) * 0.01
    rows = []
    for rule, (ours, theirs, torch_forms, states) in _rules().items():
        if only and rule not in only:
            continue
        contenders = {"tightfit 8-bit": (ours, True), "bitsandbytes 8-bit": (theirs, True)}
        contenders.update({label: (make, False) for label, make in torch_forms.items()})
        made = {}
        for label, (make, eight_bit) in contenders.items():
            if label == "bitsandbytes 8-bit" and _bnb() is None:
                continue
            p = torch.randn(numel, device=device) * 0.1
            p.grad = grad
            optimizer = make([p])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optimizer.step()  # state created, kernels compiled
            made[label] = (optimizer, eight_bit, [])
        for _ in range(rounds):
            roof.measure()
            order = list(made)
            random.shuffle(order)
            for label in order:
                made[label][2].append(_step_time(made[label][0], device))
        for label, (optimizer, eight_bit, times) in made.items():
            median, low, high = spread(times)
            moved = _moved_bytes(numel, states, eight_bit)
            rows.append(
                {
                    "rule": rule,
                    "numel": numel,
                    "implementation": label,
                    "step_ms": median * 1e3,
                    "spread": (high - low) / median,
                    "state_bytes": _state_bytes(optimizer),
                    "moved_bytes": moved,
                    "roof_share": moved / median / roof.bandwidth,
                }
            )
        del made
    return rows


def _table(rows: list[dict], roof: UpdateRoof) -> str:
    by_key = {(r["rule"], r["numel"], r["implementation"]): r for r in rows}
    lines = []
    for row in rows:
        theirs = by_key.get((row["rule"], row["numel"], "bitsandbytes 8-bit"))
        adam32 = by_key.get(("Adam", row["numel"], "torch Adam fused"))
        lines.append(
            [
                row["rule"],
                f"{row['numel'] / MIB:g}M" if row["numel"] >= MIB else f"{row['numel'] / 1024:g}K",
                row["implementation"],
                f"{row['step_ms']:.1f}",
                f"{row['spread'] * 100:.0f}%",
                f"{theirs['step_ms'] / row['step_ms']:.2f}x" if theirs else "",
                f"{row['state_bytes'] / MIB:.1f}",
                f"{row['state_bytes'] / adam32['state_bytes'] * 100:.1f}%" if adam32 else "",
                f"{row['roof_share'] * 100:.0f}%",
            ]
        )
    headers = [
        "rule",
        "values",
        "implementation",
        "step ms (median)",
        "spread",
        "vs bitsandbytes",
        "state MiB",
        "state / 32-bit Adam",
        "roof",
    ]
    return markdown_table(headers, lines) + (
        f"\n\nroof (in-place update bandwidth) {roof.bandwidth / 1e9:.1f} GB/s, median of {len(roof.samples)}"
    )


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": MIB}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default), or an accelerator such as cuda")
    parser.add_argument("--sizes", nargs="+", default=["16M", "128M"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rules", nargs="*", help="only these rules (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "optim.md")
    args = parser.parse_args()
    random.seed(0)
    torch.manual_seed(0)
    device = torch.device(args.device)
    roof = UpdateRoof(device)
    rows = []
    for size in args.sizes:
        rows += run_size(_size(size), args.rounds, roof, args.rules, device)
        print(f"{size} done", file=sys.stderr)
    table = _table(rows, roof)
    text = "\n".join(
        [
            "# 8-bit optimizer steps on the CPU",
            "",
            *machine_lines(
                {"device": str(device), "torch threads": str(torch.get_num_threads()), "rounds": str(args.rounds)}
            ),
            "",
            table,
            "",
        ]
    )
    print(text)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "update_roof": roof.samples}, indent=1))


if __name__ == "__main__":
    main()
