"""``tightfit stages``: a model cut into pipeline stages across the processes ``torchrun``
starts (or the ranks ``--ranks`` names, for ``--plan-only``), each within its own budget:
the stage plan before any weight is read, then the run, with every rank's predicted
against measured peak and the bytes it read in one table (rank 0 prints it)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from tightfit._files import read_text
from tightfit._format import human_bytes
from tightfit._validate import check_count, check_type
from tightfit.app.generation_job import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROMPT
from tightfit.app.models import default_model_dir, load_tokenizer
from tightfit.app.run import DEFAULT_SENTENCES
from tightfit.app.spelling import option
from tightfit.distributed import (
    Ranks,
    StagePlan,
    StageRun,
    plan_stages,
    process_group,
    rank_device,
    ranks_from_environment,
    run_local,
    run_stage,
    shared_devices,
    shared_inputs,
    shared_plan,
)
from tightfit.distributed.pricing import measured_hops
from tightfit.fitting import Allow
from tightfit.kinds import CAUSAL_LM
from tightfit.loading.folder import folder_kind, model_folder

__all__ = ["add_parser", "handle", "read_sentences", "stage_budgets"]

_MOST_SENTENCE_BYTES = 64 << 20


def stage_budgets(text: str, ranks: int) -> list[str] | dict[str, str]:
    """``--budget``: one size for every rank, one per rank (comma-separated), or one per
    device of this process (``cuda:0=20GB,cpu=64GB``: stages in one process)."""
    check_type("text", text, str)
    check_count("ranks", ranks, least=1)
    sizes = [part.strip() for part in text.split(",")]
    if any("=" in size for size in sizes):
        pairs = [size.partition("=") for size in sizes]
        if not all(device.strip() and sep and value.strip() for device, sep, value in pairs):
            raise ValueError(
                f"{option('budget')} {text!r}: a budget per device is DEVICE=SIZE for each device, comma-separated "
                f"(e.g. cuda:0=20GB,cpu=64GB)"
            )
        devices = [device.strip() for device, _, _ in pairs]
        if len(set(devices)) != len(devices):
            raise ValueError(f"{option('budget')} {text!r} names a device twice; give each device one size")
        return {device.strip(): value.strip() for device, _, value in pairs}
    if len(sizes) == 1:
        return sizes * ranks
    if len(sizes) != ranks or not all(sizes):
        raise ValueError(
            f"{option('budget')} {text!r} names {len(sizes)} sizes for {ranks} ranks; give one size for every rank "
            f"or one per rank, comma-separated (e.g. 60MB,80MB)"
        )
    return sizes


def read_sentences(file: str) -> list[str]:
    """``--sentences``: the file's non-blank lines, one sentence each."""
    try:
        text = read_text(file, limit=_MOST_SENTENCE_BYTES)
    except OSError as error:
        raise ValueError(f"{option('sentences')} {file!r} cannot be read: {error.strerror or error}") from None
    except ValueError as error:
        raise ValueError(f"{option('sentences')}: {error}") from None
    sentences = [line.strip() for line in text.splitlines() if line.strip()]
    if not sentences:
        raise ValueError(f"{option('sentences')} {file!r} holds no sentence; give one sentence per line")
    return sentences


def _local_rank(environ: Any, rank: int) -> int:
    """This rank's index on its node: ``LOCAL_RANK``, which torchrun sets (its rank outside it)."""
    text = environ.get("LOCAL_RANK", str(rank))
    if not text.isdigit():
        raise ValueError(f"LOCAL_RANK={text!r} must be an integer >= 0 (torchrun sets it)")
    return int(text)


def _inputs(folder: Any, kind: str, prompt: str, sentences: list[str]) -> dict[str, torch.Tensor]:
    tokenizer = load_tokenizer(folder)
    if kind == CAUSAL_LM:
        return {"input_ids": tokenizer(prompt, return_tensors="pt")["input_ids"]}
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def handle(args: argparse.Namespace, console: Console) -> int:
    """Plan on rank 0, share the plan, run every rank's stage, print the table on rank 0."""
    folder = model_folder(args.model) if args.model else default_model_dir()
    kind = folder_kind(folder)
    launched = ranks_from_environment()
    if args.ranks is not None and not args.plan_only:
        raise ValueError(f"{option('ranks')} is for {option('plan_only')}; a run has the ranks torchrun starts")
    ranks = Ranks(0, args.ranks) if args.ranks is not None else launched
    if ranks.world < 1:
        raise ValueError(f"{option('ranks')} must be >= 1, got {ranks.world}")
    new_tokens = args.max_new_tokens if kind == CAUSAL_LM else 0
    if args.sentences is not None and kind == CAUSAL_LM:
        raise ValueError(f"{option('sentences')} is for an encoder; {folder} is a causal LM, which takes --prompt")
    sentences = read_sentences(args.sentences) if args.sentences is not None else list(DEFAULT_SENTENCES)
    inputs = _inputs(folder, kind, args.prompt, sentences)
    allow = Allow.parse(args.allow) if args.allow else None
    budgets = stage_budgets(args.budget, ranks.world)
    per_device = isinstance(budgets, dict)
    if per_device and args.device != "cpu":
        raise ValueError(f"{option('device')} is for ranks; {option('budget')} {args.budget!r} names the devices")
    if per_device and (args.ranks is not None or launched.world > 1):
        raise ValueError(
            f"{option('budget')} {args.budget!r} gives a budget per device, which runs the stages in this process; "
            f"for ranks, give one size per rank"
        )

    local_rank = _local_rank(os.environ, ranks.rank)

    def make(hops=None, devices=None):
        return plan_stages(
            folder,
            budgets,
            inputs,
            kind=kind,
            max_new_tokens=new_tokens,
            allow=allow,
            devices=devices,
            hops=hops,
            micro_batches=args.micro_batches,
        )

    if args.plan_only:  # the ranks of one node
        plan = make(devices=None if per_device else [rank_device(args.device, r) for r in range(ranks.world)])
        print(plan.to_json()) if args.json else console.print(escape(str(plan)), highlight=False, soft_wrap=True)
        return 0
    if per_device:
        plan = make()
        if not args.json:
            console.print(escape(str(plan)), highlight=False, soft_wrap=True)
        run = run_local(folder, plan, inputs, max_new_tokens=new_tokens, repeat=args.repeat)
        return _print_result(run, plan, folder, args, console)
    with process_group(ranks, args.timeout):
        inputs = shared_inputs(inputs, ranks)
        devices = shared_devices(rank_device(args.device, local_rank), ranks)
        hops = measured_hops(ranks.rank, ranks.world, args.timeout) if ranks.world > 1 else None
        plan = shared_plan(lambda: make(hops, devices), ranks)
        if ranks.rank == 0 and not args.json:
            console.print(escape(str(plan)), highlight=False, soft_wrap=True)
        run = run_stage(
            folder, plan, inputs, ranks, max_new_tokens=new_tokens, repeat=args.repeat, timeout_seconds=args.timeout
        )
    return 0 if run is None else _print_result(run, plan, folder, args, console)


def _print_result(run: StageRun, plan: StagePlan, folder: Any, args: argparse.Namespace, console: Console) -> int:
    if args.json:
        print(json.dumps(run.to_dict() | {"plan": json.loads(plan.to_json())}, indent=2))
    else:
        _print_run(run, folder, console)
    return 0


def _print_run(run: StageRun, folder: Any, console: Console) -> None:
    if run.plan.kind == CAUSAL_LM:
        text = load_tokenizer(folder).decode(list(run.tokens))
        console.print(
            f"generated {len(run.tokens)} tokens in {run.seconds:.3f} s ({len(run.tokens) / run.seconds:.1f} tokens/s): "
            f"{text!r}",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    else:
        console.print(f"embedded {run.embeddings.shape[0]} sentences in {run.seconds * 1e3:.1f} ms", highlight=False)
    console.print(
        f"{'rank':>4}  {'budget':>10} {'predicted':>10} {'measured':>10} {'loading':>10} {'peak RSS':>10} {'read':>10} "
        f"{'its tensors':>11} {'ms/run':>8} {'send/recv ms':>12} {'compute pred.':>13} {'sends pred.':>11} "
        f"{'sent':>9} {'planned':>9}",
        highlight=False,
        markup=False,
    )
    for r in run.reports:
        rss = human_bytes(r.peak_rss_bytes) if r.peak_rss_bytes is not None else "-"
        read = human_bytes(r.read_bytes) if r.read_bytes is not None else "-"
        sends = f"{r.predicted_send_seconds * 1e3:.2f}" if r.predicted_send_seconds is not None else "-"
        console.print(
            f"{r.rank:>4}  {human_bytes(r.budget_bytes):>10} {human_bytes(r.predicted_peak_bytes):>10} "
            f"{human_bytes(r.measured_peak_bytes):>10} {human_bytes(r.load_peak_bytes):>10} {rss:>10} {read:>10} "
            f"{human_bytes(r.stage_read_bytes):>11} {r.seconds * 1e3:>8.2f} {r.link_seconds * 1e3:>12.2f} "
            f"{r.predicted_seconds * 1e3:>13.2f} {sends:>11} {human_bytes(r.sent_bytes):>9} "
            f"{human_bytes(r.predicted_sent_bytes):>9}",
            highlight=False,
            markup=False,
        )
    within = sum(r.within_budget for r in run.reports)
    console.print(
        f"a run: predicted {run.plan.predicted_seconds * 1e3:.2f} ms, measured {run.seconds * 1e3:.2f} ms (the "
        f"slowest rank's median; the ranks start each run together)",
        highlight=False,
        markup=False,
    )
    console.print(
        f"{within} of {len(run.reports)} ranks within their budgets (measured: {run.reports[0].measured_by}; "
        f"loading: the peak while its checkpoint streamed in; read: the process's read calls while loading; "
        f"send/recv: waiting for the peer included; pred.: the plan's, in ms)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``stages``, its options and :func:`handle` on the CLI's subcommands."""
    parser = commands.add_parser(
        "stages",
        parents=parents,
        help="run a model cut into pipeline stages across the processes torchrun starts, each within its budget",
    )
    parser.add_argument("--model", metavar="DIR", help="a local Hugging Face folder (default: the built-in model)")
    parser.add_argument(
        "--budget",
        required=True,
        metavar="SIZE[,SIZE...]",
        help="memory each rank may use: one size for every rank, or one per rank (e.g. 60MB or 50MB,70MB); or "
        "DEVICE=SIZE for each device of this process (e.g. cuda:0=20GB,cpu=64GB), its stages run in this process",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="TYPE",
        help="each rank's device: cpu (default), or an accelerator type (cuda, xpu, ...), each rank taking the one "
        "of its local rank",
    )
    parser.add_argument("--ranks", type=int, help="with --plan-only: the ranks to plan for (default: WORLD_SIZE)")
    parser.add_argument("--plan-only", action="store_true", help="print the stage plan and stop; nothing is read")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="a causal LM's prompt")
    parser.add_argument(
        "--sentences", metavar="FILE", help="an encoder's batch: a text file, one sentence per line (default: built-in)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="a causal LM's tokens to generate"
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        metavar="N",
        help="an encoder's batch in N parts through the stages, so that the stages work at once (default: 1)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed runs after a warm-up (default: 3)")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a rank waits on a peer before the run ends (default: 60)"
    )
    parser.add_argument(
        "--allow", metavar="NAMES", help="storages and placements the stages may use (default: keep, device)"
    )
    parser.add_argument("--json", action="store_true", help="print the plan and every rank's report as JSON")
    parser.set_defaults(handler=handle)
