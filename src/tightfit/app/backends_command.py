"""``tightfit backends``: every backend the entry points name, with availability, memory,
capabilities and load errors, as a table or JSON.

A backend that fails to load, or whose figures fail to read, is a row with its error (D3):
the command reports it instead of failing.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tightfit._format import dtype_names, human_bytes
from tightfit.backends import FLOAT8_DTYPES, all_backends
from tightfit.backends import conflict as find_conflict

__all__: list[str] = []


def _backend_row(entry) -> dict:
    """One backend's figures for the report; reading them may fail and is reported."""
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
        row["features"] = (
            ", ".join(f for f in ("async_copy", "unified_memory", "paged_memory") if getattr(caps, f)) or "none"
        )
    return row


def handle(args: argparse.Namespace, console: Console) -> int:
    """Print the report; exit status 1 when two plugins claim one device."""
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


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``backends``, its options and :func:`handle` on the CLI's subcommands."""
    parser = commands.add_parser(
        "backends", parents=parents, help="list backends: availability, memory, capabilities, load errors"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=handle)
