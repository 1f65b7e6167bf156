"""``tightfit plan``: the memory plan of the built-in model or a local Hugging Face folder.

Only the folder's config.json is read: the model is built on the meta device and
planned with fake tensors, so a model larger than this machine plans as fast as a
small one. The output names the planned inputs (``--batch`` x ``--seq`` token ids), as
their size sets the activations' part of the total.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from tightfit.app.models import default_model_dir, model_skeleton
from tightfit.app.spelling import assigned, option
from tightfit.memory.plan import MemoryPlan, plan_memory

__all__ = ["plan_model"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option(name)} must be an int >= 1, got {value!r}")
    return value


def plan_model(
    *,
    model: str | None = None,
    batch: int = 8,
    seq: int = 128,
    backend: Any = None,
    training: bool = False,
    runtime: str = "compiled",
    order: str = "best",
) -> tuple[MemoryPlan, str]:
    """(plan, description of the model) for token ids of shape (batch, seq)."""
    _positive("batch", batch)
    _positive("seq", seq)
    folder = default_model_dir() if model is None else model
    described = "all-MiniLM-L6-v2 (built-in default)" if model is None else str(model)
    skeleton, config = model_skeleton(folder)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq > limit:
        raise ValueError(f"{assigned('seq', seq)} is longer than the model takes: {limit} (max_position_embeddings)")
    skeleton.train(training)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    kwargs = {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}
    if training:
        for parameter in skeleton.parameters():
            parameter.requires_grad_(True)
    plan = plan_memory(skeleton, ids, kwargs=kwargs, backend=backend, training=training, runtime=runtime, order=order)
    return plan, described


def handle(args: argparse.Namespace, console: Console) -> int:
    """Plan, optionally draw the timeline, and print the plan with the inputs it is for."""
    plan, described = plan_model(
        model=args.model,
        batch=args.batch,
        seq=args.seq,
        backend=args.backend,
        training=args.training,
        runtime=args.runtime,
        order=args.order,
    )
    if args.plot:
        plan.plot(args.plot)
    if args.json:
        inputs = {"batch": args.batch, "seq": args.seq}
        print(json.dumps({"model_source": described, "inputs": inputs, **plan.to_dict(), "plot": args.plot}, indent=2))
        return 0
    console.print(f"model  {described}", highlight=False)
    console.print(f"inputs token ids, batch {args.batch} x {args.seq} tokens (--batch, --seq)", highlight=False)
    console.print(escape(str(plan)), highlight=False, soft_wrap=True)
    if args.plot:
        console.print(f"timeline written to {escape(args.plot)}", highlight=False)
    return 0


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``plan``, its options and :func:`handle` on the CLI's subcommands."""
    plan = commands.add_parser(
        "plan", parents=parents, help="plan a model's memory before running it (no weight is loaded)"
    )
    plan.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model folder (default: the built-in model); only its config is read",
    )
    plan.add_argument("--batch", type=int, default=8, help="batch size of the planned call (default: 8)")
    plan.add_argument("--seq", type=int, default=128, help="sequence length of the planned call (default: 128)")
    plan.add_argument("--backend", help="backend name or device to plan for (default: the default backend)")
    plan.add_argument("--training", action="store_true", help="plan one training step (forward and backward)")
    plan.add_argument(
        "--runtime",
        choices=["compiled", "arena", "eager"],
        default="compiled",
        help="as torch.compile(backend='tightfit') runs it (default), the same inside its planned "
        "arena (options={'memory': 'arena'}), or as eager PyTorch does",
    )
    plan.add_argument(
        "--order",
        choices=["best", "written", "depth-first", "breadth-first", "least-peak"],
        default="best",
        help="order of the ops (default: the candidate with the lowest peak)",
    )
    plan.add_argument("--plot", help="also write a PNG timeline to this path (needs tightfit[plot])")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(handler=handle)
