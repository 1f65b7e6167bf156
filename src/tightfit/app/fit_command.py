"""``tightfit fit``: the dry run. The plan ``tightfit run --budget`` would carry out for a
model folder (or the built-in model), made from its config and its checkpoint's headers
(the dtype each tensor is stored in; none where the folder holds only its config): no
weight byte is read, so a model bigger than this machine plans in seconds, and a budget nothing meets
is refused here, before anything is loaded (exit status 2, naming the smallest peak
reachable and what dominates it). ``--json`` prints the plan as JSON.

The folder is ``--model DIR``, as for ``run`` and ``plan``. ``tightfit fit DIR``, the
spelling of earlier releases, still works and says on stderr that it is deprecated."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markup import escape

from tightfit._format import human_bytes
from tightfit.app.run import RunOptions, plan_only
from tightfit.app.run_command import add_planner_arguments
from tightfit.fitting import PLACEMENTS, storage_names

__all__: list[str] = []


def _folder(args: argparse.Namespace) -> str | None:
    """``--model DIR``, or the deprecated positional ``DIR``; not both."""
    if args.folder is None:
        return args.model
    if args.model is not None:
        raise ValueError(
            f"the model folder is given twice, as --model={args.model} and as {args.folder}; give it once, as --model DIR"
        )
    print(
        f"tightfit fit: note: 'tightfit fit DIR' is deprecated; write 'tightfit fit --model {args.folder}'",
        file=sys.stderr,
    )
    return args.folder


def handle(args: argparse.Namespace, console: Console) -> int:
    """Plan, print the plan, exit."""
    budgeted = plan_only(
        RunOptions(
            model=_folder(args),
            backend=args.backend,
            prompt=args.prompt,
            max_new_tokens=args.max_new_tokens,
            budget=args.budget,
            context=args.context,
            allow=args.allow,
            max_error=args.max_error,
            kv_cache=args.kv_cache,
            units=args.units,
        )
    )
    plan = budgeted.plan
    if args.json:
        data = {
            "predicted_peak_bytes": budgeted.predicted_peak_bytes,
            "kv_cache_bytes": budgeted.kv_cache_bytes,
            "context": budgeted.context,
            "kv_cache_format": budgeted.kv_format,
            "prediction_covers": budgeted.covers,
            "plan": plan.to_dict(),
        }
        print(json.dumps(data, indent=2))
        return 0
    console.print(escape(str(plan)), highlight=False, soft_wrap=True)
    console.print(
        f"predicted peak of the whole run {human_bytes(budgeted.predicted_peak_bytes)}: {budgeted.covers}, and loading; "
        f"nothing was loaded (tightfit run --budget carries this plan out)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    return 0


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``fit``, its options and :func:`handle` on the CLI's subcommands."""
    fit = commands.add_parser(
        "fit",
        parents=parents,
        help="plan a model for a memory budget from its config, before loading anything (a dry run)",
    )
    fit.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face model folder (default: the built-in model); its config and its checkpoint's "
        "headers are read, no weight",
    )
    fit.add_argument("folder", nargs="?", metavar="DIR", help=argparse.SUPPRESS)  # deprecated: --model DIR
    fit.add_argument(
        "--budget",
        required=True,
        metavar="SIZE",
        help="memory the whole run may use on the device, loading included, e.g. 6GB, 1.5GiB, 123456 (bytes)",
    )
    fit.add_argument(
        "--allow",
        metavar="NAMES",
        help=f"what the planner may use: storages ({', '.join(storage_names())}) and/or placements "
        f"({', '.join(PLACEMENTS)}), comma-separated",
    )
    fit.add_argument("--backend", help="backend name or device, e.g. cpu, cuda, cuda:1 (default: best available)")
    fit.add_argument("--prompt", help="causal LMs and encoder-decoders: the run's prompt (default: tightfit run's)")
    fit.add_argument(
        "--max-new-tokens", type=int, help="causal LMs and encoder-decoders: tokens the run generates (default: 16)"
    )
    add_planner_arguments(fit)
    fit.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    fit.set_defaults(handler=handle)
