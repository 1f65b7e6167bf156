"""The training fit at 75, 50 and 30% of a training step's unplanned peak, a full fine-tune
and a QLoRA one, beside PyTorch's own activation budget.

The model is a Llama-style causal LM built from a config (random weights: this measures
memory and time, not quality), trained on its next-token loss over a batch of token ids.
"Unplanned" is the step with every activation kept and 32-bit AdamW state on the device,
as `fit(..., training=True)` predicts it with no budget. Each row plans for its budget,
applies the plan to a fresh copy, and runs steps: predicted against measured peak (the
allocator's, read from its events), the step's median seconds over the timed steps. QLoRA
is the same model frozen with rank-16 adapters beside its layers' Linears.

PyTorch's knob, `torch._functorch.config.activation_memory_budget`, is a ratio of the
activation memory that `torch.compile` (inductor) may keep, not bytes: its rows give each
ratio's measured peak and step time for the same step (torch.optim.AdamW, fused, 32-bit
state), so one can read which of the budgets each ratio would meet.

On an accelerator the plans may also offload activations to host memory and page the
optimizer's state; torch.compile's rows run on the CPU only.

Run: python benchmarks/train_fit.py [--steps 4] [--device cpu|cuda] [--size small|tiny] [--shares 0.75 0.5 0.3]
[--no-torch] [--out benchmarks/results/train_fit.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_lines, markdown_table  # noqa: E402

import tightfit  # noqa: E402
from tightfit.fitting import Calibration, calibrate  # noqa: E402
from tightfit.memory import allocated_peak, measure_training_step  # noqa: E402
from tightfit.quant import add_lora  # noqa: E402

SHARES = (0.75, 0.5, 0.3)
RATIOS = (1.0, 0.5, 0.2, 0.0)
#: The model's config by size: "small" the committed figures', "tiny" the GPU check's CPU mode.
CONFIGS = {
    "small": dict(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4),
}


def llama(size: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIGS[size], use_cache=False))


def models(size: str) -> dict[str, torch.nn.Module]:
    full = llama(size)
    adapted = llama(size)
    torch.manual_seed(1)
    add_lora(adapted, rank=16)
    return {"full fine-tune": full, "QLoRA (rank 16)": adapted}


def describe(plan) -> str:
    parts = [f"{plan.optim_bits}-bit state"]
    if plan.activations:
        parts.append(f"{len(plan.activations)} of {len(plan.layers)} layers recomputed")
    stored = sorted({entry.storage for entry in plan.changed_entries()})
    if stored:
        parts.append("frozen base " + "/".join(stored))
    return ", ".join(parts)


def planned_rows(
    name: str, model: torch.nn.Module, batch: dict, figures: Calibration, steps: int, device: str, shares: list[float]
) -> list[list]:
    unplanned = tightfit.fit(model, batch, 1 << 40, training=True, calibration=figures, backend=device)
    rows = []
    for share in (None, *shares):  # None: no budget, the unplanned step
        budget = unplanned.full_peak_bytes if share is None else int(unplanned.full_peak_bytes * share)
        started = time.perf_counter()
        try:
            plan = tightfit.fit(
                model, batch, 1 << 40 if share is None else budget, training=True, calibration=figures, backend=device
            )
        except tightfit.FitError as error:
            least = f"no plan: the least reachable is {error.smallest_peak_bytes / 2**20:.1f} MiB, mostly {error.parts[0][0]}"
            rows.append([name, f"{share:.0%}", f"{budget / 2**20:.1f}", "", "", "", "", least])
            print(rows[-1], flush=True)
            continue
        planning = time.perf_counter() - started
        applied = plan.apply(copy.deepcopy(model))
        optimizer = plan.make_optimizer(applied.parameters(), lr=1e-4)
        measured, _ = measure_training_step(applied, (), batch, optimizer, device, steps=2)
        seconds = [measured.median_seconds]
        for _ in range(steps - 1):  # more timed steps
            again, _ = measure_training_step(applied, (), batch, optimizer, device, steps=1)
            seconds.append(again.median_seconds)
        peak = measured.allocated_peak_bytes
        rows.append(
            [
                name,
                "unplanned" if share is None else f"{share:.0%}",
                f"{budget / 2**20:.1f}",
                f"{plan.predicted_peak_bytes / 2**20:.1f}",
                f"{peak / 2**20:.1f}",
                f"{peak / plan.predicted_peak_bytes:.3f}",
                "yes" if peak <= budget else "NO",
                f"{statistics.median(seconds) * 1e3:.0f} ms ({describe(plan)}; planned in {planning:.1f} s)",
            ]
        )
        print(rows[-1], flush=True)
    return rows


def torch_rows(name: str, model: torch.nn.Module, batch: dict, steps: int) -> list[list]:
    """The same step under torch.compile with PyTorch's activation budget at each ratio (a
    frozen base stays float32: PyTorch has no storage choice)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    rows = []
    for ratio in RATIOS:
        torch._dynamo.reset()
        functorch_config.activation_memory_budget = ratio
        trained = copy.deepcopy(model)
        compiled = torch.compile(trained)
        optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-4, fused=True)

        def step() -> None:
            loss = compiled(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        started = time.perf_counter()
        step()  # compiles, and makes the optimizer's state
        compiling = time.perf_counter() - started
        held = sum(t.numel() * t.element_size() for t in [*trained.parameters(), *trained.buffers()])
        held += sum(
            t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        )
        peak = held + allocated_peak(step)
        seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - started)
        rows.append(
            [
                name,
                f"{ratio:g}",
                f"{peak / 2**20:.1f}",
                f"{statistics.median(seconds) * 1e3:.0f} ms (compiled in {compiling:.0f} s)",
            ]
        )
        print(rows[-1], flush=True)
    functorch_config.activation_memory_budget = 1.0
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row (default 4)")
    parser.add_argument("--device", default="cpu", help="the device to plan for and train on (default: cpu)")
    parser.add_argument("--size", choices=list(CONFIGS), default="small", help="the model (default: small)")
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES), help="budgets, shares of unplanned")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--no-torch", action="store_true", help="skip torch.compile's activation budget rows")
    parser.add_argument("--out", type=Path, help="write the tables as markdown here")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = CONFIGS[args.size]
    ids = torch.randint(0, config["vocab_size"], (args.batch, args.seq), device=args.device)
    batch = {"input_ids": ids, "labels": ids}
    figures = calibrate(args.device)
    planned, compiled = [], []
    for name, model in models(args.size).items():
        planned += planned_rows(name, model.to(args.device), batch, figures, args.steps, args.device, args.shares)
        if not args.no_torch and args.device == "cpu":
            compiled += torch_rows(name.replace("QLoRA", "LoRA, base float32"), model, batch, args.steps)
    lines = [
        "# The training fit against PyTorch's activation budget",
        "",
        f"`python benchmarks/train_fit.py --steps {args.steps} --device {args.device} --size {args.size}`; a "
        f"Llama-style LM of {sum(p.numel() for p in llama(args.size).parameters()) / 1e6:.1f}M parameters "
        f"({config['num_hidden_layers']} layers, hidden {config['hidden_size']}), batch {args.batch} x {args.seq} "
        f"tokens, next-token loss; peaks are the {args.device} allocator's, MiB.",
        "",
        *machine_lines({}),
        "",
        "## tightfit: fit(..., training=True) at a share of the unplanned step",
        "",
        markdown_table(
            [
                "model",
                "budget",
                "budget MiB",
                "predicted MiB",
                "measured MiB",
                "measured / predicted",
                "within",
                "step",
            ],
            planned,
        ),
    ]
    if compiled:
        lines += [
            "",
            "## torch.compile with torch._functorch.config.activation_memory_budget (torch.optim.AdamW, fused)",
            "",
            markdown_table(["model", "ratio", "measured MiB", "step"], compiled),
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
