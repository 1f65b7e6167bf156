"""``tightfit run``: the main job (:mod:`tightfit.app.run`) from the command line, its report
printed as tables (:mod:`tightfit.app.output`) or as JSON."""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

from rich.console import Console

from tightfit._progress import show_progress
from tightfit.app.output import print_report, print_start, report_data
from tightfit.app.run import GRAPH_CHOICES, STORAGE_DTYPE_CHOICES, RunOptions, quant_configs
from tightfit.app.run import run as run_job
from tightfit.fitting import PLACEMENTS, storage_names
from tightfit.fitting.options import UNIT_SIZES

__all__: list[str] = []


def handle(args: argparse.Namespace, console: Console) -> int:
    """Run, measure and print the report.

    The model, the backend and a budget's plan are printed (and flushed) the moment the
    plan is made, before loading (without a budget, once the model has loaded); the rest
    after the run. With ``--json`` stdout holds one
    JSON document, printed at the end (the plan is its ``plan``), and nothing else."""
    options = RunOptions(
        model=args.model,
        backend=args.backend,
        quant=args.quant,
        storage_dtype=args.storage_dtype,
        offload=args.offload,
        repeat=args.repeat,
        keep_8bit=not args.all_4bit,
        compute=args.compute,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        timeline=args.timeline,
        budget=args.budget,
        allow=args.allow,
        reference=not args.no_reference,
        context=args.context,
        plan=args.plan,
        max_error=args.max_error,
        kv_cache=args.kv_cache,
        graph=args.graph,
        units=args.units,
    )
    bars = Console(stderr=True)
    with show_progress(bars) if bars.is_terminal and not args.json else nullcontext():  # stderr only, never in --json
        report = run_job(options, on_start=None if args.json else lambda start: print_start(start, console))
    if args.json:
        print(json.dumps(report_data(report), indent=2))
        return 0
    print_report(report, console, started=True)
    return 0


def context_value(text: str) -> int | str:
    """``--context``'s value: a number of positions, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of positions or 'auto', got {text!r}") from None


def add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    """``--context``, ``--kv-cache``, ``--max-error`` and ``--units`` for ``run`` and ``fit``: the same words in both."""
    parser.add_argument(
        "--kv-cache",
        choices=["auto", "model", "float8"],
        default="auto",
        help="causal LMs: the KV cache's format, the model's dtype or float8 (a byte a value, a scale per position "
        "and head); auto: the model's, unless the budget holds the run, or a longer --context auto, only with "
        "float8 (default: auto)",
    )
    parser.add_argument(
        "--max-error",
        metavar="PCT",
        help="with --budget: the most expected error the plan may take to meet it, e.g. 10%% lets 4-bit in "
        "(default: 3%%, 8-bit class, exceeded only where the budget needs more, and said so)",
    )
    parser.add_argument(
        "--units",
        choices=list(UNIT_SIZES),
        default="layers",
        help="with --budget: what the planner decides for, per layer: the whole layer, or its blocks (attention, "
        "feed-forward network, each expert of a mixture of experts) (default: layers)",
    )
    parser.add_argument(
        "--context",
        type=context_value,
        metavar="N|auto",
        help="causal LMs, with --budget: positions (prompt and generated) the KV cache is planned for; auto: the "
        "longest the budget allows, at most the model's (default: what the run reaches)",
    )


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``run``, its options and :func:`handle` on the CLI's subcommands."""
    run = commands.add_parser(
        "run", parents=parents, help="run a model (default: the built-in all-MiniLM-L6-v2) and measure it"
    )
    run.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model folder, an encoder (embeds sentences) or a causal LM "
        "(generates text) (default: the built-in model)",
    )
    run.add_argument("--backend", help="backend name or device, e.g. cpu, cuda, cuda:1 (default: best available)")
    run.add_argument(
        "--quant",
        choices=list(quant_configs()),
        help="quantize the Linear layers first (nf4, fp4: the later half of the layers in 8 bits) and compare with full precision",
    )
    run.add_argument(
        "--all-4bit",
        action="store_true",
        help="with nf4 or fp4, store every Linear layer in 4 bits (default: the later half of the layers in 8 bits)",
    )
    run.add_argument(
        "--compute",
        choices=["float", "int8"],
        default="float",
        help="with nf4, fp4 or 8bit: how the quantized layers multiply; int8 quantizes activations to int8 per "
        "block of 32 and multiplies in integers (faster on CPUs, less exact; default: float)",
    )
    run.add_argument(
        "--storage-dtype",
        choices=list(STORAGE_DTYPE_CHOICES),
        help="store weights so (layerwise casting; norms and embeddings stay) and compute in the model's dtype",
    )
    run.add_argument(
        "--offload",
        choices=["cpu", "disk"],
        help="keep weights in CPU memory or memory-mapped files; each block comes onto the device when it runs",
    )
    run.add_argument(
        "--graph",
        choices=list(GRAPH_CHOICES),
        default="auto",
        help="causal LMs: decode by replaying one captured CUDA graph of the step (no host work per token); "
        "auto: where the run allows it (a CUDA device, every weight on it, the KV cache in the model's dtype); "
        "on: refused where it does not (default: auto)",
    )
    run.add_argument(
        "--budget",
        metavar="SIZE",
        help="device memory the run may use, e.g. 40MB, 1.5GiB, 123456 (bytes): the fit "
        "planner chooses per layer how weights are stored and where; "
        "not with --quant, --storage-dtype or --offload",
    )
    run.add_argument(
        "--allow",
        metavar="NAMES",
        help="with --budget: what the planner may use, comma-separated storages "
        f"({', '.join(storage_names())}) and/or placements ({', '.join(PLACEMENTS)}), "
        "e.g. keep,float8,disk; a kind you name nothing of stays unrestricted",
    )
    run.add_argument(
        "--plan",
        metavar="FILE",
        help="carry out a plan made before (tightfit fit --json > FILE), its budget the run's; "
        "not with --budget, --allow, --context or --max-error",
    )
    run.add_argument("--repeat", type=int, default=5, help="timed repetitions (default: 5)")
    run.add_argument(
        "--prompt",
        help="causal LMs: the text to continue; encoder-decoders: their input (default: a fixed story opening)",
    )
    run.add_argument(
        "--max-new-tokens", type=int, help="causal LMs and encoder-decoders: tokens to generate greedily (default: 16)"
    )
    add_planner_arguments(run)
    run.add_argument("--timeline", help="also write a PNG of memory over one run to this path (needs tightfit[plot])")
    run.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the full-precision reference run that quality is measured against (a model the machine "
        "cannot hold twice; a budgeted run skips it by itself where the model takes over half the free memory)",
    )
    run.add_argument("--json", action="store_true", help="print JSON instead of tables")
    run.set_defaults(handler=handle)
