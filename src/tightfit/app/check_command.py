"""``tightfit check``: the conformance harness (D4), every op on every available backend and
every CPU kernel against the reference on the CPU, as a table and an ``N/M passed`` line.

A full check runs long on a small CPU (the fast kernels compile at first use), so each op
is a progress bar on stderr while it runs (when stderr is a terminal).
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

from rich.console import Console
from rich.table import Table

from tightfit._progress import show_progress
from tightfit.ops.conformance import run_checks

__all__: list[str] = []

_STYLES = {"OK": "green", "FAIL": "red", "not supported": "yellow"}


def handle(args: argparse.Namespace, console: Console) -> int:
    """Run the checks and print them; exit status 1 when any failed."""
    bars = Console(stderr=True)
    with show_progress(bars) if bars.is_terminal else nullcontext():
        results = run_checks(ops=args.op or None)
    table = Table(title="tightfit conformance")
    for column in ("op", "backend", "kernel", "case", "result"):
        table.add_column(column, overflow="fold")
    for result in results:
        if args.failures_only and result.status == "OK":
            continue
        outcome = f"[{_STYLES[result.status]}]{result.status}[/]" + (f" {result.detail}" if result.detail else "")
        table.add_row(result.op, result.backend, result.kernel, result.case, outcome)
    console.print(table)
    passed = sum(result.status == "OK" for result in results)
    failed = sum(result.status == "FAIL" for result in results)
    unsupported = len(results) - passed - failed
    console.print(f"{passed}/{passed + failed} passed, {failed} failed, {unsupported} not supported", highlight=False)
    return 1 if failed else 0


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``check``, its options and :func:`handle` on the CLI's subcommands."""
    parser = commands.add_parser(
        "check", parents=parents, help="run the conformance harness: every op on every backend vs the reference"
    )
    parser.add_argument("--op", action="append", help="check only this op (repeatable)")
    parser.add_argument("--failures-only", action="store_true", help="list only checks that did not pass")
    parser.set_defaults(handler=handle)
