"""One compact-weight linear layer on the CPU, call by call: microseconds per call and the
stored weight bytes read per second, for every storage tightfit has and bitsandbytes' CPU
functions, against the machine's read-bandwidth roof measured in the same run.

For each weight shape (in x out: ``nn.Linear(2048, 5632)`` and ``nn.Linear(4096, 4096)``)
and each number of tokens (1, 8, 128; input bfloat16, 4 of the input columns hold
activations of magnitude 8, so that LLM.int8()'s outlier path runs at threshold 6.0):

- ``bf16 F.linear``: the bfloat16 weight, ``torch.nn.functional.linear``;
- tightfit ``Linear4bit`` nf4 (blocksize 64, with and without ``compress_statistics``,
  and with ``compute="int8"``), fp4 (blocksize 64); ``Linear8bit`` (8-bit blockwise,
  blocksize 4096 and 256, and 4096 with ``compute="int8"``);
  ``LinearInt8`` (LLM.int8(), threshold 6.0 and 0.0); and a bfloat16 ``nn.Linear`` stored
  in float8 e4m3 by ``tightfit.hooks.apply_layerwise_casting`` (computed in bfloat16);
- bitsandbytes (when installed): ``bnb.matmul_4bit`` (nf4, blocksize 64; it takes
  ``gemv_4bit`` for one token), ``bnb.functional.gemv_4bit`` (one token only),
  ``dequantize_blockwise`` + ``F.linear`` (8-bit blockwise, blocksize 4096) and
  ``bnb.nn.Linear8bitLt`` (threshold 6.0 and 0.0). bitsandbytes is known to compute wrong
  values on some CPUs; its rows are only timed, never checked.

Each layer is used only through its public class or function, so new kernels behind them
count as soon as they land.

Timing: the weights a row reads must come from memory, not from the last-level cache
(300 MiB on some servers), so each row holds a pool of copies of its layer, together at
least ``--pool-mib`` (default: 1.25 x the last-level cache, at least 256 MiB), and its calls
cycle through the pool. For each (shape, tokens) every row's layers are built first; then
``--rounds`` rounds run every row once, in an order that rotates from round to round, each
row for a batch of calls lasting about 20 ms (at least 2 calls), each call timed on its
own; a row's figure is the median over all its calls (``calls`` of them), with the 10th and
90th percentiles as spread (on a machine other work shares, the median of single calls is
what bursts of load move least).
The read roof (``torch.sum`` over a 1 GiB float32 buffer, :mod:`_common`) is measured before
each (shape, tokens) and at the end; its median is the roof.

Columns: ``us/call`` (median, and p10-p90); ``GB/s``: the layer's stored bytes (weight,
scales, maps, as held) over the time per call; ``of roof``: that over the read bandwidth
(100%: the call runs at memory speed; many tokens are compute-bound, so their figures are
low by nature); ``x bf16``: bf16's time over the row's (above 1: faster than bf16).

Threads: 2 by default, under the policy the ``tightfit`` command sets
(``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=3000``; the script restarts itself with them
where neither is set); on a busy machine long-spinning OpenMP threads turn every call into a
scheduler time slice.
``--quiet-load L`` first waits (at most 30 minutes) for a 1-minute load average <= L.

Run (2 threads by default, as a small decode box has):
    .venv/bin/python benchmarks/matmul_cpu.py [--threads 2] [--rounds 15] [--tokens 1 8 128]
        [--shapes 2048x5632 4096x4096] [--pool-mib N] [--rows SUBSTRING ...] [--out PATH] [--quiet-load L]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import (
    ReadRoof,
    add_quiet_load_option,
    as_tightfit_run_threads,
    last_level_cache_bytes,
    load_average,
    machine_lines,
    markdown_table,
    module_bytes,
    tensor_bytes,
    wait_for_quiet,
)
from torch import nn

from tightfit.hooks import apply_layerwise_casting
from tightfit.quant import Linear4bit, Linear8bit, LinearInt8

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnb_functional
except ImportError:  # the comparison is optional; tightfit's rows still run
    bnb = bnb_functional = None

RESULTS = Path(__file__).resolve().parent / "results" / "matmul_cpu.md"
BATCH_SECONDS = 0.02


@dataclass(frozen=True)
class Row:
    """One way to compute ``x @ W.T``: ``build(linear)`` makes a layer from a bfloat16
    ``nn.Linear``, ``call(layer, x)`` runs it, ``nbytes(layer)`` counts what it stores.
    ``copyable``: pool copies are ``copy.deepcopy`` of the first (else each is built)."""

    name: str
    build: Callable[[nn.Linear], object]
    call: Callable[[object, torch.Tensor], torch.Tensor]
    nbytes: Callable[[object], int]
    copyable: bool = True
    one_token_only: bool = False


def _state_bytes(state) -> int:
    """A bitsandbytes QuantState's tensors, nested state included."""
    tensors = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return tensor_bytes(tensors)


def _module_call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _float8(linear: nn.Linear) -> nn.Module:
    layer = copy.deepcopy(linear)
    apply_layerwise_casting(layer, torch.float8_e4m3fn, torch.bfloat16)
    return layer


def tightfit_rows() -> list[Row]:
    def nf4(compress: bool, quant_type: str = "nf4", compute: str = "float") -> Callable[[nn.Linear], nn.Module]:
        return lambda linear: Linear4bit.from_linear(
            linear, quant_type=quant_type, blocksize=64, compress_statistics=compress, compute=compute
        )

    return [
        Row(
            "bf16 F.linear",
            lambda linear: linear.weight.detach().clone(),
            lambda w, x: F.linear(x, w),
            lambda w: tensor_bytes([w]),
        ),
        Row("tightfit nf4 bs64", nf4(False), _module_call, module_bytes),
        Row("tightfit nf4 bs64 compress_statistics", nf4(True), _module_call, module_bytes),
        Row("tightfit nf4 bs64 int8 compute", nf4(False, compute="int8"), _module_call, module_bytes),
        Row("tightfit fp4 bs64", nf4(False, "fp4"), _module_call, module_bytes),
        Row(
            "tightfit 8bit bs4096",
            lambda linear: Linear8bit.from_linear(linear, blocksize=4096),
            _module_call,
            module_bytes,
        ),
        Row(
            "tightfit 8bit bs4096 int8 compute",
            lambda linear: Linear8bit.from_linear(linear, blocksize=4096, compute="int8"),
            _module_call,
            module_bytes,
        ),
        Row(
            "tightfit 8bit bs256",
            lambda linear: Linear8bit.from_linear(linear, blocksize=256),
            _module_call,
            module_bytes,
        ),
        Row(
            "tightfit int8 t6.0",
            lambda linear: LinearInt8.from_linear(linear, threshold=6.0),
            _module_call,
            module_bytes,
        ),
        Row(
            "tightfit int8 t0.0",
            lambda linear: LinearInt8.from_linear(linear, threshold=0.0),
            _module_call,
            module_bytes,
        ),
        Row("tightfit float8 e4m3 cast", _float8, _module_call, module_bytes, copyable=False),
    ]


def bnb_rows() -> list[Row]:
    if bnb is None:
        return []

    def four_bit(linear: nn.Linear):
        return bnb_functional.quantize_4bit(linear.weight.detach(), blocksize=64, quant_type="nf4")

    def four_bit_bytes(layer) -> int:
        return tensor_bytes([layer[0]]) + _state_bytes(layer[1])

    def eight_bit(linear: nn.Linear):
        return bnb_functional.quantize_blockwise(linear.weight.detach(), blocksize=4096)

    def eight_bit_call(layer, x: torch.Tensor) -> torch.Tensor:
        q, state = layer
        return F.linear(x, bnb_functional.dequantize_blockwise(q, state).to(x.dtype))

    def lt(threshold: float) -> Callable[[nn.Linear], nn.Module]:
        def build(linear: nn.Linear) -> nn.Module:
            layer = bnb.nn.Linear8bitLt(
                linear.in_features, linear.out_features, bias=False, has_fp16_weights=False, threshold=threshold
            )
            layer.weight = bnb.nn.Int8Params(
                linear.weight.detach().clone(), requires_grad=False, has_fp16_weights=False
            )
            return layer.to("cpu").eval()  # the move quantizes (int8 rows, SCB)

        return build

    def lt_bytes(layer: nn.Module) -> int:
        return tensor_bytes([layer.weight.data, getattr(layer.weight, "SCB", None)])

    return [
        Row(
            "bnb matmul_4bit nf4 bs64",
            four_bit,
            lambda layer, x: bnb.matmul_4bit(x, layer[0].t(), quant_state=layer[1]),
            four_bit_bytes,
        ),
        Row(
            "bnb gemv_4bit nf4 bs64",
            four_bit,
            lambda layer, x: bnb_functional.gemv_4bit(x, layer[0].t(), state=layer[1]),
            four_bit_bytes,
            one_token_only=True,
        ),
        Row(
            "bnb dequantize_blockwise+F.linear bs4096",
            eight_bit,
            eight_bit_call,
            lambda layer: tensor_bytes([layer[0]]) + _state_bytes(layer[1]),
        ),
        Row("bnb Linear8bitLt t6.0", lt(6.0), _module_call, lt_bytes, copyable=False),
        Row("bnb Linear8bitLt t0.0", lt(0.0), _module_call, lt_bytes, copyable=False),
    ]


def inputs(tokens: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Normal bfloat16 activations; 4 fixed columns hold +-8 (LLM.int8()'s outliers at 6.0)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=generator)
    columns = torch.arange(4) * (in_features // 4) + 7
    x[:, columns] = 8.0 * torch.sign(x[:, columns] + 0.5)
    return x.to(torch.bfloat16)


@dataclass
class Pool:
    row: Row
    layers: list[object]
    nbytes: int
    calls: int = 1
    index: int = 0
    samples: list[float] | None = None

    def run(self, x: torch.Tensor, calls: int) -> list[float]:
        """The seconds of each of ``calls`` calls, cycling through the pool."""
        call, layers, seconds = self.row.call, self.layers, []
        for _ in range(calls):
            start = time.perf_counter()
            call(layers[self.index], x)
            seconds.append(time.perf_counter() - start)
            self.index = (self.index + 1) % len(layers)
        return seconds


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def build_pool(row: Row, linear: nn.Linear, pool_bytes: int) -> Pool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = row.build(linear)
    nbytes = row.nbytes(first)
    copies = max(1, math.ceil(pool_bytes / nbytes))
    layers = [first]
    for _ in range(copies - 1):
        layers.append(copy.deepcopy(first) if row.copyable else row.build(linear))
    return Pool(row, layers, nbytes, samples=[])


@torch.inference_mode()
def bench_case(
    in_features: int, out_features: int, tokens: int, rows: list[Row], rounds: int, pool_bytes: int
) -> list[dict]:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    nn.init.normal_(linear.weight, std=0.02)
    x = inputs(tokens, in_features)
    pools = [build_pool(row, linear, pool_bytes) for row in rows if tokens == 1 or not row.one_token_only]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pool in pools:  # warm-up, and how many calls make a batch of about BATCH_SECONDS
            pool.run(x, 1)
            estimate = min(pool.run(x, 2))
            pool.calls = max(2, min(500, math.ceil(BATCH_SECONDS / estimate)))
        for round_index in range(rounds):
            shift = round_index % len(pools)
            for pool in pools[shift:] + pools[:shift]:
                pool.samples += pool.run(x, pool.calls)
    results = []
    for pool in pools:
        median = statistics.median(pool.samples)
        low, high = percentile(pool.samples, 0.1), percentile(pool.samples, 0.9)
        results.append(
            {
                "shape": f"{in_features}x{out_features}",
                "tokens": tokens,
                "row": pool.row.name,
                "seconds": median,
                "low": low,
                "high": high,
                "nbytes": pool.nbytes,
                "copies": len(pool.layers),
                "calls": len(pool.samples),
            }
        )
    return results


def report(results: list[dict], roof: ReadRoof, header: list[str]) -> str:
    bandwidth = roof.bandwidth
    lines = ["# Compact-weight linear layers on the CPU, per call", "", *header, ""]
    cases = sorted({(r["shape"], r["tokens"]) for r in results}, key=lambda c: (c[0] != "2048x5632", c[0], c[1]))
    headers = ["row", "us/call", "p10-p90", "calls", "stored MB", "GB/s", "of roof", "x bf16"]
    for shape, tokens in cases:
        rows = [r for r in results if r["shape"] == shape and r["tokens"] == tokens]
        base = next((r["seconds"] for r in rows if r["row"] == "bf16 F.linear"), None)
        table = []
        for r in rows:
            rate = r["nbytes"] / r["seconds"]
            table.append(
                [
                    r["row"],
                    f"{r['seconds'] * 1e6:.0f}",
                    f"{r['low'] * 1e6:.0f}-{r['high'] * 1e6:.0f}",
                    str(r["calls"]),
                    f"{r['nbytes'] / 1e6:.1f}",
                    f"{rate / 1e9:.1f}",
                    f"{rate / bandwidth:.0%}",
                    f"{base / r['seconds']:.2f}" if base else "n/a",
                ]
            )
        lines += [
            f"## {shape} (in x out), {tokens} token{'s' if tokens > 1 else ''}",
            "",
            markdown_table(headers, table),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128])
    parser.add_argument("--shapes", nargs="+", default=["2048x5632", "4096x4096"], help="in x out, e.g. 2048x5632")
    parser.add_argument("--pool-mib", type=int, default=None, help="bytes each row's pool of copies holds at least")
    parser.add_argument("--rows", nargs="+", default=None, help="keep the rows whose name contains one of these")
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_quiet_load_option(parser)
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be >= 1")
    threading = as_tightfit_run_threads()  # may start the script again, before any work
    torch.set_num_threads(args.threads)
    cache = last_level_cache_bytes() or 0
    pool_bytes = (args.pool_mib << 20) if args.pool_mib else max(256 << 20, int(1.25 * cache))
    rows = tightfit_rows() + bnb_rows()
    if args.rows:
        rows = [row for row in rows if row.name == "bf16 F.linear" or any(part in row.name for part in args.rows)]
    quiet = wait_for_quiet(args.quiet_load)
    load_before = load_average()
    started = time.perf_counter()
    roof = ReadRoof()
    results = []
    for shape in args.shapes:
        in_features, out_features = (int(n) for n in shape.lower().split("x"))
        for tokens in args.tokens:
            roof.measure()
            print(f"{shape} x {tokens} tokens ...", flush=True)
            results += bench_case(in_features, out_features, tokens, rows, args.rounds, pool_bytes)
    roof.measure()
    roof.release()
    header = machine_lines(
        {
            "threading": f"{args.threads} threads, {threading} (as the tightfit command sets it)",
            "read roof": roof.describe(),
            "load average (1, 5, 15 min) before / after": f"{load_before} / {load_average()} ({quiet})",
            "bitsandbytes": getattr(bnb, "__version__", "not installed"),
            "rounds": f"{args.rounds}; pools of at least {pool_bytes >> 20} MiB per row",
            "wall time": f"{time.perf_counter() - started:.0f} s",
            "command": "python benchmarks/matmul_cpu.py "
            + f"--threads {args.threads} --rounds {args.rounds} --tokens {' '.join(map(str, args.tokens))} "
            + f"--shapes {' '.join(args.shapes)}"
            + (f" --quiet-load {args.quiet_load}" if args.quiet_load is not None else "")
            + (f" --rows {' '.join(args.rows)}" if args.rows else ""),
        }
    )
    text = report(results, roof, header)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
