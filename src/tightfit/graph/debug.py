"""``TIGHTFIT_DEBUG=sched``: print every split of every compiled graph, its inputs (and
which are copied from another device), its schedule, how it runs, and why each node
went where it went."""

from __future__ import annotations

import os
import sys
from typing import TextIO

import torch.fx

from tightfit.graph import _nodes
from tightfit.graph.assign import Assignment
from tightfit.graph.execution import Program
from tightfit.graph.honor import HintLedger

__all__ = ["DEBUG_TOPICS", "debug_topics", "describe", "maybe_print"]

_ENV = "TIGHTFIT_DEBUG"
#: Topics ``TIGHTFIT_DEBUG`` accepts (comma-separated).
DEBUG_TOPICS = ("sched",)


def debug_topics() -> set[str]:
    """The topics set in ``$TIGHTFIT_DEBUG``; an unknown topic is a ValueError."""
    raw = os.environ.get(_ENV, "")
    topics = {part.strip().lower() for part in raw.split(",") if part.strip()}
    unknown = topics - set(DEBUG_TOPICS)
    if unknown:
        raise ValueError(
            f"{_ENV}={raw!r} is not accepted: unknown topic {', '.join(sorted(unknown))}; "
            f"accepted: {', '.join(DEBUG_TOPICS)} (comma-separated)"
        )
    return topics


def describe(program: Program, assignment: dict[torch.fx.Node, Assignment], ledger: HintLedger | None = None) -> str:
    """The schedule of one compiled graph as text."""
    copies = sum(len(step.split.copies) for step in program.steps)
    lines = [f"tightfit sched: {program.name} graph, {len(program.steps)} split(s), {copies} copied input(s)"]
    owner = {node: step.split for step in program.steps for node in step.split.nodes}
    for step in program.steps:
        split = step.split
        lines.append(
            f"split {split.index}: backend {split.backend.name} on {split.device}, {split.schedule}, "
            f"runs as {step.how}, {len(split.nodes)} node(s)"
        )
        inputs = [_input(node, split, owner.get(node)) for node in split.inputs]
        lines.append(f"  inputs:  {', '.join(inputs) or '-'}")
        lines.append(f"  outputs: {', '.join(node.name for node in split.outputs) or '-'}")
        for node in split.nodes:
            where = assignment.get(node)
            lines.append(f"    {node.name:<28} {_nodes.op_name(node):<34} {where.reason if where else ''}")
    for message in ledger.ignored if ledger else []:
        lines.append(f"  ignored: {message}")
    return "\n".join(lines)


def _input(node: torch.fx.Node, split: object, producer: object) -> str:
    if node in split.copies:
        return f"{node.name} (copied from {split.copies[node]})"
    if producer is not None and producer.backend is not split.backend:
        return f"{node.name} (from split {producer.index} on {producer.backend.name}, same device: no copy)"
    return node.name


def maybe_print(
    program: Program, assignment: dict[torch.fx.Node, Assignment], ledger: HintLedger, stream: TextIO | None = None
) -> None:
    """Print :func:`describe` to stderr when ``TIGHTFIT_DEBUG`` includes ``sched``."""
    if "sched" in debug_topics():
        print(describe(program, assignment, ledger), file=stream or sys.stderr, flush=True)
