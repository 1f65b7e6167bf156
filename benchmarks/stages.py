"""A causal LM cut into 1, 2 and 4 pipeline stages at the same total budget (each rank
one share of it), each run with `tightfit stages` under torchrun on gloo (localhost):
tokens/s, every rank's predicted and measured peak against its budget, the seconds each
rank spends in send and receive per generation, and the bytes each rank read while
loading. Beside it, accelerate's `device_map="auto"` in one process with one rank's share
as its `max_memory` (the rest offloaded to disk): on a CPU-only machine accelerate has no
second device, so that is what it does with the same per-device budget.

The model is Llama-style with random weights (this measures memory and time, not
quality): 512 hidden, 12 layers, the default model's 30,522-token vocabulary, float32
(``--size tiny``: 64 hidden, 4 layers, for a quick check). ``--devices cuda:0 cpu`` runs the
stages on those devices of one process instead (`tightfit stages --budget
cuda:0=SIZE,cpu=SIZE`), beside accelerate's `device_map` with the same `max_memory`.

Each rank's predicted compute and sends are shown beside what it measured, and each
generation's predicted seconds (the plan's: compute and sends, one stage after another)
beside its measured.

``--encoder``: the built-in encoder over a batch of ``--sentences`` sentences on 2 ranks
in each number of ``--micro-batches``, and in one process, alternated over ``--rounds``
rounds: peaks predicted and measured, a batch's time predicted and measured
(benchmarks/results/stages_encoder.md).

Run: python benchmarks/stages.py [--total 380MB] [--ranks 1 2 4 | --devices DEV ...]
[--size small|tiny] [--new-tokens 32] [--no-accelerate] [--out FILE]
or: python benchmarks/stages.py --encoder [--sentences 64] [--micro-batches 1 4 8] [--rank-budget 80MB]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ReadRoof, machine_lines, markdown_table  # noqa: E402

from tightfit._format import human_bytes  # noqa: E402
from tightfit.app.generation_job import DEFAULT_PROMPT  # noqa: E402
from tightfit.app.models import save_causal_lm  # noqa: E402
from tightfit.distributed import StagePlan  # noqa: E402
from tightfit.fitting import parse_size  # noqa: E402

SIZES = {
    "small": dict(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
}


def run_stages(folder: Path | None, budget: str, new_tokens: int, ranks: int | None, options=()) -> dict:
    """``tightfit stages --json`` as a user types it: under torchrun with ``ranks``
    processes, or (``ranks`` None, a budget per device) in one process; ``folder`` None:
    the built-in encoder."""
    tightfit = str(Path(sys.executable).with_name("tightfit"))
    command = [tightfit, "stages", *(["--model", str(folder)] if folder else []), "--budget", budget]
    command += ["--max-new-tokens", str(new_tokens), "--repeat", "3", "--json", *options]
    env = dict(os.environ)
    if ranks is not None:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        command = [*launch, "--no-python", *command]
        env["OMP_NUM_THREADS"] = str(max(os.cpu_count() // ranks, 1))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout)


def run_accelerate(folder: Path, max_memory: dict, new_tokens: int) -> dict:
    """accelerate's device_map in one process with ``max_memory``, the rest offloaded to disk."""
    script = f"""
import json, time, tempfile, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tightfit.backends.cpu import read_process_memory, reset_process_peak
reset_process_peak()  # the peak RSS a process inherits through exec (its parent's) is not its own
tokenizer = AutoTokenizer.from_pretrained({str(folder)!r})
ids = tokenizer({DEFAULT_PROMPT!r}, return_tensors="pt")["input_ids"]
with tempfile.TemporaryDirectory() as offload:
    model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, device_map="auto", max_memory={max_memory!r},
                                                 offload_folder=offload)
    placed = {{str(v) for v in getattr(model, "hf_device_map", {{"": "cpu"}}).values()}}
    model.generate(ids, max_new_tokens=2, do_sample=False)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens={new_tokens}, min_new_tokens={new_tokens}, do_sample=False)
        times.append(time.perf_counter() - start)
times.sort()
print(json.dumps({{"seconds": times[1], "placed": sorted(placed), "peak_rss": read_process_memory()[1],
                  "tokens": out[0, ids.shape[1]:].tolist()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rows(label: str, budget: str, run: dict, new_tokens: int) -> list[list[str]]:
    rows = []
    for report in run["reports"]:
        rows.append(
            [
                label if report["rank"] == 0 else "",
                budget,
                f"{report['rank']} ({report['device']}): {report['holds']}",
                human_bytes(report["predicted_peak_bytes"]),
                human_bytes(report["measured_peak_bytes"]),
                human_bytes(report["peak_rss_bytes"]) if report["peak_rss_bytes"] is not None else "-",
                "yes" if report["within_budget"] else "NO",
                f"{report['link_seconds'] * 1e3:.1f}",
                _predicted_ms(report),
                human_bytes(report["read_bytes"]) if report["read_bytes"] is not None else "-",
                f"{run['plan_seconds']:.2f} / {run['seconds']:.2f}" if report["rank"] == 0 else "",
                f"{new_tokens / run['seconds']:.1f}" if report["rank"] == 0 else "",
            ]
        )
    return rows


def _publish(lines: list[str], out: Path) -> None:
    """Print the results' page and write it to ``out``."""
    text = "\n".join(lines) + "\n"
    print(text)
    out.write_text(text)


def _plan_seconds(run: dict) -> float:
    """The run's predicted seconds, read from the plan it printed."""
    return StagePlan.from_json(json.dumps(run["plan"])).predicted_seconds


def encoder_main(args: argparse.Namespace) -> None:
    """The built-in encoder on ``--sentences`` sentences over 2 ranks, in each number of
    ``--micro-batches``, and in one process: per-rank predicted and measured peaks, and a
    batch's predicted and measured seconds, the configurations alternated over
    ``--rounds`` rounds (medians and ranges)."""
    from tightfit.app.run import DEFAULT_SENTENCES

    configs = [(f"tightfit, 2 ranks, {n} micro-batches", 2, n) for n in args.micro_batches]
    configs.append(("tightfit, one process, both budgets (2 threads)", None, 1))
    seconds: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    last: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        sentences = Path(scratch) / "sentences.txt"
        lines = [DEFAULT_SENTENCES[i % len(DEFAULT_SENTENCES)] for i in range(args.sentences)]
        sentences.write_text("\n".join(lines))
        for _ in range(args.rounds):
            for label, ranks, parts in configs:
                budget = args.rank_budget if ranks else f"cpu={2 * parse_size(args.rank_budget, '--rank-budget')}"
                options = ["--sentences", str(sentences), "--micro-batches", str(parts)]
                run = run_stages(None, budget, 0, ranks, options)
                if "error" in run:
                    raise SystemExit(f"{label}: {run['error']}")
                seconds[label].append(run["seconds"])
                last[label] = run
    rows = []
    for label, _, _ in configs:
        run, times = last[label], sorted(seconds[label])
        for report in run["reports"]:
            rows.append(
                [
                    label if report["rank"] == 0 else "",
                    f"{report['rank']}: {report['holds']}",
                    human_bytes(report["budget_bytes"]),
                    human_bytes(report["predicted_peak_bytes"]),
                    human_bytes(report["measured_peak_bytes"]),
                    _predicted_ms(report),
                    f"{_plan_seconds(run) * 1e3:.1f}" if report["rank"] == 0 else "",
                    f"{statistics.median(times) * 1e3:.1f} ({times[0] * 1e3:.1f}-{times[-1] * 1e3:.1f})"
                    if report["rank"] == 0
                    else "",
                    f"{args.sentences / statistics.median(times):.0f}" if report["rank"] == 0 else "",
                ]
            )
    lines = [
        "# The built-in encoder in stages, in micro-batches",
        "",
        *machine_lines(
            {
                "model": "all-MiniLM-L6-v2 (the built-in encoder), float32",
                "batch": f"{args.sentences} sentences (the built-in 8, repeated), padded to 12 positions",
            }
        ),
        "",
        f"Command: `python benchmarks/stages.py --encoder --sentences {args.sentences} --micro-batches "
        f"{' '.join(map(str, args.micro_batches))} --rank-budget {args.rank_budget} --rounds {args.rounds}`",
        "",
        markdown_table(
            [
                "run",
                "rank: holds",
                "budget",
                "predicted peak",
                "measured peak",
                "predicted ms: compute + sends",
                "predicted ms a batch",
                f"measured ms a batch: median (range of {args.rounds})",
                "sentences/s",
            ],
            rows,
        ),
        "",
        "Each run is `tightfit stages --json` as typed, under torchrun for the ranks (one thread each), the",
        "configurations alternated round by round. A batch's time is the slowest rank's median of 3 runs, the",
        "ranks starting each run together (a batch's latency: batches do not overlap across the ranks).",
    ]
    _publish(lines, args.out)


def _predicted_ms(report: dict) -> str:
    """A rank's predicted compute + sends per run, in ms."""
    sends = report["predicted_send_seconds"]
    return f"{report['predicted_seconds'] * 1e3:.1f} + " + (f"{sends * 1e3:.1f}" if sends is not None else "-")


def _accelerate_row(label: str, budget: str, result: dict, new_tokens: int) -> list[str]:
    if "error" in result:
        return [label, budget, *["-"] * 9, result["error"][:120]]
    return [
        label,
        budget,
        f"placed on {', '.join(result['placed'])}",
        "-",
        "-",
        human_bytes(result["peak_rss"]),
        "-",
        "-",
        "-",
        "-",
        f"- / {result['seconds']:.2f}",
        f"{new_tokens / result['seconds']:.1f}",
    ]


def _memory_key(device: str) -> int | str:
    """accelerate's max_memory key for a device: its index for an accelerator, "cpu"."""
    parsed = torch.device(device)
    return "cpu" if parsed.type == "cpu" else (parsed.index or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", default="380MB", help="the total budget, shared equally by the ranks or devices")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--devices", nargs="+", help="instead of ranks: stages on these devices of one process (e.g. cuda:0 cpu)"
    )
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--out", type=Path, help="default: results/stages.md, or results/stages_encoder.md")
    parser.add_argument("--encoder", action="store_true", help="the built-in encoder in micro-batches instead")
    parser.add_argument("--sentences", type=int, default=64, help="--encoder: the batch's sentences")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8], help="--encoder: each run's")
    parser.add_argument("--rank-budget", default="80MB", help="--encoder: each rank's budget")
    parser.add_argument("--rounds", type=int, default=3, help="--encoder: rounds of the alternated runs")
    args = parser.parse_args()
    results = Path(__file__).parent / "results"
    args.out = args.out or results / ("stages_encoder.md" if args.encoder else "stages.md")
    if args.encoder:
        encoder_main(args)
        return
    total = parse_size(args.total, "--total")
    sizes = SIZES[args.size]
    rows, tokens, speeds = [], {}, []
    roof = None if args.devices else ReadRoof()  # the CPU's read roof bounds the ranks' decode
    with tempfile.TemporaryDirectory() as scratch:
        folder = save_causal_lm(Path(scratch) / "lm", **sizes, seed=0)
        weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        # a decode step reads every weight but the embedding table, of which it reads a row
        per_token = weights - 30522 * sizes["hidden_size"] * 4
        if args.devices:
            per = total // len(args.devices)
            configs = [("tightfit, one process", ",".join(f"{d}={per}" for d in args.devices), None)]
            accelerated = [({_memory_key(d): per for d in args.devices}, human_bytes(per))]
        else:
            configs = [(f"tightfit, {n} ranks", str(total // n), n) for n in args.ranks]
            accelerated = [({"cpu": total // n}, human_bytes(total // n)) for n in args.ranks[1:]]
        for label, budget, ranks in configs:
            if roof is not None:
                roof.measure()
            shown = human_bytes(total // (ranks or len(args.devices)))
            run = run_stages(folder, budget, args.new_tokens, ranks)
            if "error" in run:
                rows.append([label, shown, *["-"] * 9, run["error"]])
                continue
            run["plan_seconds"] = _plan_seconds(run)
            tokens[label] = tuple(run["tokens"])
            rows += _rows(label, shown, run, args.new_tokens)
            speeds.append((rows[-len(run["reports"])], args.new_tokens / run["seconds"]))
        for max_memory, shown in [] if args.no_accelerate else accelerated:
            if roof is not None:
                roof.measure()
            result = run_accelerate(folder, max_memory, args.new_tokens)
            rows.append(_accelerate_row("accelerate device_map (one process)", shown, result, args.new_tokens))
            if "error" not in result:
                speeds.append((rows[-1], args.new_tokens / result["seconds"]))
    if roof is not None:
        roof.measure()
        for row, speed in speeds:
            row.append(f"{speed * per_token / roof.bandwidth:.0%}")
    for row in rows:
        row.extend([""] * (13 - len(row)))
    same = len(set(tokens.values())) <= 1
    how = f"--devices {' '.join(args.devices)}" if args.devices else f"--ranks {' '.join(map(str, args.ranks))}"
    lines = [
        "# A causal LM cut into stages at the same total budget",
        "",
        *machine_lines(
            {
                "model": f"Llama-style, {sizes}, float32, {human_bytes(weights)} of weights",
                "total budget": human_bytes(total),
            }
        ),
        "",
        f"Command: `python benchmarks/stages.py --total {args.total} {how} --size {args.size} --new-tokens {args.new_tokens}`",
        "",
        markdown_table(
            [
                "run",
                "budget per rank or device",
                "stage (device): holds",
                "predicted",
                "measured",
                "peak RSS",
                "within",
                "ms in send/recv (copies) per generation",
                "predicted ms: compute + sends",
                "read while loading",
                "s a generation: predicted / measured",
                "tokens/s",
                "of roof",
            ],
            rows,
        ),
        "",
        f"Generated tokens the same in every tightfit run: {'yes' if same else 'NO'} ({len(tokens)} runs).",
    ]
    if roof is not None:
        lines += [
            f"Roof: {roof.describe()}, measured before each run and at the end; of roof: tokens/s times",
            f"the {human_bytes(per_token)} a decode step reads (every weight but the embedding table) over it.",
        ]
    lines += [
        "Measured: live tensors (weights + created by the run) on the CPU, the allocator's peak on an",
        "accelerator. In send/recv: the seconds a rank spends in point-to-point calls per generation,",
        "waiting for its peer included (the stages run one after another at batch 1); in one process,",
        "the copies between devices. Peak RSS: the whole process (Python, torch, transformers; for",
        "accelerate, the pages of its disk offload too). accelerate's max_memory bounds the weights it",
        "places on a device, not what the process holds.",
    ]
    _publish(lines, args.out)


if __name__ == "__main__":
    main()
