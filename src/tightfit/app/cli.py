"""The ``tightfit`` command: ``backends``, ``check``, ``run`` and ``plan``.

A user error (a bad argument, a broken model folder, a full disk, a device that cannot
be used) is one line on stderr and exit status 2, as argparse reports a bad flag;
anything else is a bug and keeps its traceback. ``--traceback`` shows it for both.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from contextlib import nullcontext

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tightfit._strict import is_strict

__all__ = ["main"]

#: What describes the user's input or machine rather than a bug in tightfit: D7's ValueError
#: and TypeError, RuntimeError for device state, OSError (unreadable files, a full disk),
#: MemoryError.
_USER_ERRORS = (ValueError, TypeError, RuntimeError, OSError, MemoryError)


def _backend_row(entry) -> dict:
    """One backend's figures for the report; reading them may fail and is reported."""
    from tightfit._format import dtype_names, human_bytes
    from tightfit.backends import FLOAT8_DTYPES

    backend = entry.backend
    row = {
        "name": backend.name if backend else entry.entry_point,
        "device": backend.device_type if backend else "-",
        "available": entry.available,
        "priority": backend.priority if backend else None,
        "memory": None,
        "compute": None,
        "float8 storage": None,
        "features": None,
        "from": entry.origin,
        "error": entry.error,
    }
    if row["available"]:
        try:
            info = backend.memory()
            caps = backend.capabilities()
        except RuntimeError as error:
            row["error"] = str(error)
            return row
        row["memory"] = f"{human_bytes(info.free)} free / {human_bytes(info.total)}"
        row["compute"] = dtype_names(caps.compute_dtypes)
        row["float8 storage"] = dtype_names(caps.storage_dtypes & FLOAT8_DTYPES) or "none"
        row["features"] = ", ".join(f for f in ("async_copy", "unified_memory", "paged_memory") if getattr(caps, f)) or "none"
    return row


def _backends_command(args: argparse.Namespace, console: Console) -> int:
    from tightfit.backends import all_backends, conflict as find_conflict

    rows = [_backend_row(entry) for entry in all_backends()]
    conflict = find_conflict()
    if args.json:
        print(json.dumps({"backends": rows, "conflict": str(conflict) if conflict else None}, indent=2))
        return 1 if conflict else 0
    table = Table(title="tightfit backends")
    columns = [name for name in rows[0] if name != "error"] if rows else []
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*("-" if row[c] is None else str(row[c]) for c in columns))
    console.print(table)
    for row in rows:
        if row["error"]:
            console.print(f"[yellow]{row['name']}:[/yellow] {escape(row['error'])}", highlight=False)
    if conflict:
        console.print(f"[red]error:[/red] {escape(str(conflict))}", highlight=False)
    return 1 if conflict else 0


def _check_command(args: argparse.Namespace, console: Console) -> int:
    from tightfit.ops.conformance import run_checks

    results = run_checks(ops=args.op or None)
    table = Table(title="tightfit conformance")
    for column in ("op", "backend", "kernel", "case", "result"):
        table.add_column(column, overflow="fold")
    styles = {"OK": "green", "FAIL": "red", "not supported": "yellow"}
    for result in results:
        if args.failures_only and result.status == "OK":
            continue
        outcome = f"[{styles[result.status]}]{result.status}[/]" + (f" {result.detail}" if result.detail else "")
        table.add_row(result.op, result.backend, result.kernel, result.case, outcome)
    console.print(table)
    passed = sum(result.status == "OK" for result in results)
    failed = sum(result.status == "FAIL" for result in results)
    unsupported = len(results) - passed - failed
    console.print(f"{passed}/{passed + failed} passed, {failed} failed, {unsupported} not supported", highlight=False)
    return 1 if failed else 0


def _run_command(args: argparse.Namespace, console: Console) -> int:
    from tightfit._progress import show_progress
    from tightfit.app.output import print_report, report_data
    from tightfit.app.run import RunOptions, run

    options = RunOptions(model=args.model, backend=args.backend, quant=args.quant, storage_dtype=args.storage_dtype,
                         offload=args.offload, repeat=args.repeat, keep_8bit=not args.all_4bit, prompt=args.prompt,
                         max_new_tokens=args.max_new_tokens, timeline=args.timeline, budget=args.budget, allow=args.allow)
    bars = Console(stderr=True)
    with show_progress(bars) if bars.is_terminal and not args.json else nullcontext():  # stderr only, never in --json
        report = run(options)
    if args.json:
        print(json.dumps(report_data(report), indent=2))
        return 0
    print_report(report, console)
    return 0


def _plan_command(args: argparse.Namespace, console: Console) -> int:
    from tightfit.app.plan_command import plan_model

    plan, described = plan_model(model=args.model, batch=args.batch, seq=args.seq, backend=args.backend,
                                 training=args.training, runtime=args.runtime, order=args.order)
    if args.plot:
        plan.plot(args.plot)
    if args.json:
        print(json.dumps({"model_source": described, **plan.to_dict(), "plot": args.plot}, indent=2))
        return 0
    console.print(f"model  {described}", highlight=False)
    console.print(escape(str(plan)), highlight=False, soft_wrap=True)
    if args.plot:
        console.print(f"timeline written to {escape(args.plot)}", highlight=False)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tightfit", description="Run a model on any accelerator and make it fit in its memory.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", help="on an error, print the full traceback instead of one line")
    commands = parser.add_subparsers(dest="command", required=True)
    command = functools.partial(commands.add_parser, parents=[common])
    backends = command("backends", help="list backends: availability, memory, capabilities, load errors")
    backends.add_argument("--json", action="store_true", help="print JSON instead of a table")
    check = command("check", help="run the conformance harness: every op on every backend vs the reference")
    check.add_argument("--op", action="append", help="check only this op (repeatable)")
    check.add_argument("--failures-only", action="store_true", help="list only checks that did not pass")
    run = command("run", help="run a model (default: the built-in all-MiniLM-L6-v2) and measure it")
    run.add_argument("--model", help="a local Hugging Face model folder, an encoder (embeds sentences) or a causal LM "
                                     "(generates text) (default: the built-in model)")
    run.add_argument("--backend", help="backend name or device, e.g. cpu, cuda, cuda:1 (default: best available)")
    run.add_argument("--quant", choices=["nf4", "fp4", "int8", "8bit"], help="quantize the Linear layers first (nf4, fp4: the later half of the layers in 8 bits) and compare with full precision")
    run.add_argument("--all-4bit", action="store_true",
                     help="with nf4 or fp4, store every Linear layer in 4 bits (default: the later half of the layers in 8 bits)")
    run.add_argument("--storage-dtype", choices=["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"],
                     help="store weights so (layerwise casting; norms and embeddings stay) and compute in the model's dtype")
    run.add_argument("--offload", choices=["cpu", "disk"], help="keep weights in CPU memory or memory-mapped files; each block comes onto the device when it runs")
    run.add_argument("--budget", metavar="SIZE", help="device memory the run may use, e.g. 40MB, 1.5GiB, 123456 (bytes): the fit "
                                                      "planner chooses per layer how weights are stored and where; "
                                                      "not with --quant, --storage-dtype or --offload")
    run.add_argument("--allow", metavar="NAMES", help="with --budget: what the planner may use, comma-separated storages "
                                                      "(keep, float8, 8bit, int8, nf4, fp4) and/or placements (device, cpu, disk), "
                                                      "e.g. keep,float8,disk; a kind you name nothing of stays unrestricted")
    run.add_argument("--repeat", type=int, default=5, help="timed repetitions (default: 5)")
    run.add_argument("--prompt", help="causal LMs: the text to continue (default: a fixed story opening)")
    run.add_argument("--max-new-tokens", type=int, help="causal LMs: tokens to generate greedily (default: 16)")
    run.add_argument("--timeline", help="also write a PNG of memory over one run to this path (needs tightfit[plot])")
    run.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan = command("plan", help="plan a model's memory before running it (no weight is loaded)")
    plan.add_argument("--model", help="a local Hugging Face model folder (default: the built-in model); only its config is read")
    plan.add_argument("--batch", type=int, default=8, help="batch size of the planned call (default: 8)")
    plan.add_argument("--seq", type=int, default=128, help="sequence length of the planned call (default: 128)")
    plan.add_argument("--backend", help="backend name or device to plan for (default: the default backend)")
    plan.add_argument("--training", action="store_true", help="plan one training step (forward and backward)")
    plan.add_argument("--runtime", choices=["compiled", "arena", "eager"], default="compiled",
                      help="as torch.compile(backend='tightfit') runs it (default), the same inside its planned "
                           "arena (options={'memory': 'arena'}), or as eager PyTorch does")
    plan.add_argument("--order", choices=["best", "written", "dfs", "bfs", "least-peak"], default="best",
                      help="order of the ops (default: the candidate with the lowest peak)")
    plan.add_argument("--plot", help="also write a PNG timeline to this path (needs tightfit[plot])")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tightfit`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    handlers = {"backends": _backends_command, "check": _check_command, "run": _run_command, "plan": _plan_command}
    try:
        is_strict()  # an invalid TIGHTFIT_STRICT is refused now, not at the first fallback (or never)
        return handlers[args.command](args, console)
    except _USER_ERRORS as error:
        if args.traceback:
            raise
        message = " ".join(str(error).split()) or type(error).__name__  # one line, whatever the message holds
        print(f"tightfit {args.command}: error: {message}", file=sys.stderr)
        return 2


def console_main() -> None:
    """Console-script wrapper: exit with :func:`main`'s status."""
    sys.exit(main())


if __name__ == "__main__":
    console_main()
