"""``tightfit train``: training steps within a memory budget. The model (the built-in
encoder, or a local Hugging Face folder's encoder or causal LM) is planned from its
config on the meta device, inside its objective (:mod:`tightfit.app.objectives`), by the
training fit (``fit(..., training=True)``): a budget nothing meets is refused before a
weight is read. Then it loads, the plan is applied (frozen weights stored as planned,
activation hooks), and ``--steps`` steps run with the planned optimizer; the last is
measured beside the prediction. ``--lora RANK`` freezes the model and trains adapters
beside its layers' Linears (:func:`tightfit.quant.add_lora`): with a budget that needs it,
the frozen base is stored in 8 or 4 bits (QLoRA)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape

from tightfit._format import human_bytes
from tightfit.app.objectives import objective_for
from tightfit.app.run import DEFAULT_PROMPT, DEFAULT_SENTENCES
from tightfit.fitting import FitError, fit, storage_names
from tightfit.fitting.training_plan import OPTIMIZERS, TrainingPlan
from tightfit.kinds import ENCODER
from tightfit.memory import Measurement, measure_training_step
from tightfit.quant import add_lora

__all__: list[str] = []

#: Steps run by default: the first makes the optimizer's state, the last is measured.
DEFAULT_STEPS = 3
#: The seed the adapters are drawn from, the same for the plan's skeleton and the run.
_LORA_SEED = 0
#: The momentum SGD and LARS train with (they take no default).
_MOMENTUM = 0.9
#: The seed of the steps' dropout.
_STEPS_SEED = 0


@dataclass(frozen=True)
class Trained:
    """What a ``tightfit train`` run gives: its plan, the measured last step, each step's loss."""

    plan: TrainingPlan
    measurement: Measurement
    losses: list[float]
    trained_parameters: int
    covers: str


def _inputs(tokenizer: Any, kind: str, device: torch.device) -> tuple[dict[str, torch.Tensor], str]:
    """The batch every step trains on, and what it is in words."""
    if kind == ENCODER:
        batch = tokenizer(list(DEFAULT_SENTENCES), padding=True, truncation=True, return_tensors="pt")
        inputs = {key: batch[key].to(device) for key in ("input_ids", "attention_mask")}
        shape = tuple(inputs["input_ids"].shape)
        return inputs, f"SimCSE on the {shape[0]} built-in sentences ({shape[0]} x {shape[1]} tokens, embedded twice)"
    batch = tokenizer(DEFAULT_PROMPT, return_tensors="pt")
    inputs = {key: batch[key].to(device) for key in ("input_ids", "attention_mask")}
    return inputs, f"next-token loss over the prompt ({inputs['input_ids'].shape[1]} tokens)"


def _prepared(model: torch.nn.Module, kind: str, lora: int | None) -> torch.nn.Module:
    if lora is not None:
        torch.manual_seed(_LORA_SEED)
        add_lora(model, rank=lora)
    return objective_for(model, kind)


def train(
    folder: str | None,
    budget: str,
    *,
    backend: str | None = None,
    steps: int = DEFAULT_STEPS,
    optimizer: str = "AdamW",
    lr: float = 1e-5,
    lora: int | None = None,
    allow: str | None = None,
) -> Trained:
    """Plan on the skeleton, load, apply, run ``steps`` steps (the last timed), measure one more's peak."""
    from tightfit.app.models import default_model_dir, load_model, load_tokenizer
    from tightfit.backends.resolve import resolve_backend
    from tightfit.loading.folder import folder_kind, model_folder, skeleton

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r} is not accepted: an int >= 2 (the first step makes the optimizer's state)")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise ValueError(f"lr={lr!r} is not accepted: a finite number > 0")
    if lora is not None and (isinstance(lora, bool) or not isinstance(lora, int) or lora < 1):
        raise ValueError(f"lora={lora!r} is not accepted: the adapters' rank, an int >= 1")
    path = model_folder(default_model_dir() if folder is None else folder)
    kind = folder_kind(path)
    _, device = resolve_backend(backend)
    tokenizer = load_tokenizer(path)
    inputs, covers = _inputs(tokenizer, kind, device)
    planned = _prepared(skeleton(path, kind)[0], kind, lora)
    plan = fit(planned, inputs, budget, training=True, backend=backend, allow=allow, optimizer=optimizer)
    model, _ = load_model(path, torch.device("cpu"), kind)
    trained = plan.apply(_prepared(model, kind, lora))
    settings = {"momentum": _MOMENTUM} if optimizer in ("SGD", "LARS") else {}  # theirs has no default
    step_optimizer = plan.make_optimizer(trained.parameters(), lr=lr, **settings)
    count = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    torch.manual_seed(_STEPS_SEED)  # dropout's draws: a run repeats
    measured, losses = measure_training_step(trained, (), inputs, step_optimizer, device, steps=steps)
    return Trained(plan, measured, losses, count, covers)


def handle(args: argparse.Namespace, console: Console) -> int:
    """Plan, train, print the plan and predicted against measured."""
    try:
        done = train(
            args.model,
            args.budget,
            backend=args.backend,
            steps=args.steps,
            optimizer=args.optimizer,
            lr=args.lr,
            lora=args.lora,
            allow=args.allow,
        )
    except FitError as error:
        raise ValueError(f"{error} (nothing was loaded)") from None
    plan, measured = done.plan, done.measurement
    if args.json:
        print(json.dumps(_report(done), indent=2))
        return 0
    console.print(escape(str(plan)), highlight=False, soft_wrap=True)
    console.print(f"trained: {done.trained_parameters:,} parameters; {done.covers}", highlight=False, soft_wrap=True)
    console.print("loss by step: " + ", ".join(f"{loss:.4f}" for loss in done.losses), highlight=False)
    truth = measured.peak_bytes
    lines = [
        f"last step: {measured.median_seconds * 1e3:.1f} ms",
        f"peak predicted {human_bytes(plan.predicted_peak_bytes)} ({plan.predicted_peak_bytes:,} B), measured "
        f"{human_bytes(truth)} ({truth:,} B, the allocator's peak): {truth / plan.predicted_peak_bytes - 1:+.1%}; "
        f"budget {human_bytes(plan.budget_bytes)}",
    ]
    if measured.peak_rss_bytes is not None:
        lines.append(
            f"process peak RSS {human_bytes(measured.peak_rss_bytes)} (Python, torch and the tokenizer included)"
        )
    lines.append(
        "not planned: loading (the checkpoint loads whole on the CPU, then the frozen weights are stored as planned)"
    )
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    return 0


def _report(done: Trained) -> dict[str, Any]:
    measured = done.measurement
    return {
        "plan": done.plan.to_dict(),
        "covers": done.covers,
        "trained_parameters": done.trained_parameters,
        "losses": done.losses,
        "last_step_seconds": measured.median_seconds,
        "predicted_peak_bytes": done.plan.predicted_peak_bytes,
        "measured_peak_bytes": measured.peak_bytes,
        "peak_rss_bytes": measured.peak_rss_bytes,
    }


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``train``, its options and :func:`handle` on the CLI's subcommands."""
    parser = commands.add_parser(
        "train",
        parents=parents,
        help="run training steps within a memory budget: planned before loading, measured against the plan",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="a local Hugging Face folder, an encoder or a causal LM (default: the built-in model)",
    )
    parser.add_argument(
        "--budget",
        required=True,
        metavar="SIZE",
        help="memory a training step may use on the device (weights, gradients, optimizer state, activations), "
        "e.g. 300MB, 1.5GiB, 123456 (bytes)",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps to run (default: {DEFAULT_STEPS})")
    parser.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="AdamW",
        help="the optimizer, from tightfit.optim (default: AdamW)",
    )
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate (default: 1e-5)")
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="freeze the model and train rank-RANK adapters beside its layers' Linears (QLoRA where the budget "
        "needs the base compact)",
    )
    parser.add_argument(
        "--allow",
        metavar="NAMES",
        help=f"storages the planner may give frozen weights ({', '.join(storage_names())}; those that cast or "
        "take an outlier path are not used for training), comma-separated",
    )
    parser.add_argument("--backend", help="backend name or device, e.g. cpu, cuda, cuda:1 (default: best available)")
    parser.add_argument("--json", action="store_true", help="print the plan and the measurements as JSON")
    parser.set_defaults(handler=handle)
