"""Does 8-bit optimizer state train as well as 32-bit? A small Llama-style model (the one
``lm_quality.py`` trains, on the CPython documentation's topics, bytes as tokens) trained
from the same initialization on the same batches for ``--steps`` steps with each of
tightfit's 8-bit optimizers, each one's 32-bit form, and torch's 32-bit AdamW.

Each rule runs at a learning rate suited to it (``RULES``), the same for its 8-bit and
32-bit forms and the schedule (linear warm-up over a tenth of the steps, then constant).
Reported: the final training loss (the mean over the last ``--tail`` steps, since one
batch's loss is noisy), the held-out loss at the end, and each 8-bit run's difference from
its own 32-bit form and from torch's 32-bit AdamW. The curves go to a PNG.

Run: python benchmarks/convergence.py [--steps 300] [--out benchmarks/results/convergence.md]
(about a minute per run on two cores; 15 runs)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_lines, markdown_table  # noqa: E402
from lm_quality import CONFIG, held_out_windows, split, text_bytes  # noqa: E402

import tightfit.optim as tightfit_optim  # noqa: E402

BATCH, CONTEXT = 16, 128
#: rule -> (learning rate, factory taking (params, lr, optim_bits))
RULES = {
    "AdamW": (3e-3, lambda p, lr, bits: tightfit_optim.AdamW(p, lr=lr, optim_bits=bits)),
    "AdEMAMix": (
        3e-3,
        lambda p, lr, bits: tightfit_optim.AdEMAMix(p, lr=lr, t_alpha=100, t_beta3=100, optim_bits=bits),
    ),
    "Lion": (3e-4, lambda p, lr, bits: tightfit_optim.Lion(p, lr=lr, weight_decay=0.1, optim_bits=bits)),
    "SGD momentum": (0.3, lambda p, lr, bits: tightfit_optim.SGD(p, lr, 0.9, optim_bits=bits)),
    "RMSprop": (1e-3, lambda p, lr, bits: tightfit_optim.RMSprop(p, lr=lr, optim_bits=bits)),
    "Adagrad": (3e-2, lambda p, lr, bits: tightfit_optim.Adagrad(p, lr=lr, optim_bits=bits)),
    "Adam": (3e-3, lambda p, lr, bits: tightfit_optim.Adam(p, lr=lr, optim_bits=bits)),
}


def batches(steps: int) -> list[torch.Tensor]:
    train, _ = split(text_bytes())
    generator = torch.Generator().manual_seed(1)
    offsets = torch.randint(0, len(train) - CONTEXT - 1, (steps, BATCH), generator=generator)
    return [torch.stack([train[o : o + CONTEXT + 1] for o in row.tolist()]) for row in offsets]


def fresh_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def train(make, lr: float, data: list[torch.Tensor], held: torch.Tensor) -> dict:
    model = fresh_model()
    optimizer = make(model.parameters(), lr)
    warmup = max(1, len(data) // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    losses, start = [], time.perf_counter()
    for ids in data:
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1].clone(), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    with torch.no_grad():
        held_loss = model(input_ids=held[:, :-1], labels=held[:, :-1].clone(), use_cache=False).loss.item()
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return {"losses": losses, "held_out": held_loss, "seconds": seconds, "state_bytes": state}


def plot(runs: dict[str, dict], path: Path, tail: int) -> None:
    """The curves, smoothed over ``tail`` steps: one colour per rule, 8-bit solid, 32-bit
    dashed, torch's AdamW black and dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(RULES, plt.get_cmap("tab10").colors))
    figure, axes = plt.subplots(figsize=(10, 6))
    for name, run in runs.items():
        losses = torch.tensor(run["losses"])
        smooth = losses.unfold(0, tail, 1).mean(1) if len(losses) >= tail else losses
        rule, _, width = name.rpartition(" ")
        if name.startswith("torch"):
            style = dict(color="black", linestyle=":", linewidth=1.6)
        else:
            style = dict(color=colours[rule], linestyle="-" if width == "8-bit" else "--", linewidth=1.2)
        axes.plot(range(tail - 1, tail - 1 + len(smooth)), smooth, label=name, **style)
    axes.set_xlabel("step")
    axes.set_ylabel(f"training loss (mean over {tail} steps)")
    axes.set_title("8-bit (solid) and 32-bit (dashed) optimizer state, one colour per rule; torch AdamW dotted")
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tail", type=int, default=20)
    parser.add_argument("--rules", nargs="*", help="only these rules (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "convergence.md")
    parser.add_argument("--replot", action="store_true", help="draw the PNG again from --out's JSON; train nothing")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.out.with_suffix(".json").read_text()), args.out.with_suffix(".png"), args.tail)
        return
    data, held = batches(args.steps), held_out_windows()[:32]
    runs: dict[str, dict] = {}
    runs["torch AdamW 32-bit"] = train(lambda p, lr: torch.optim.AdamW(p, lr=lr), RULES["AdamW"][0], data, held)
    for rule, (lr, make) in RULES.items():
        if args.rules and rule not in args.rules:
            continue
        for bits in (8, 32):
            runs[f"{rule} {bits}-bit"] = train(lambda p, lr, make=make, bits=bits: make(p, lr, bits), lr, data, held)
            print(f"{rule} {bits}-bit: final {runs[f'{rule} {bits}-bit']['losses'][-1]:.3f}", file=sys.stderr)

    def final(run: dict) -> float:
        return sum(run["losses"][-args.tail :]) / args.tail

    reference = final(runs["torch AdamW 32-bit"])
    rows = []
    for name, run in runs.items():
        own = runs.get(name.replace("8-bit", "32-bit")) if "8-bit" in name else None
        rows.append(
            [
                name,
                f"{RULES.get(name.rsplit(' ', 1)[0], (RULES['AdamW'][0],))[0]:g}",
                f"{final(run):.4f}",
                f"{(final(run) / final(own) - 1) * 100:+.2f}%" if own else "",
                f"{(final(run) / reference - 1) * 100:+.2f}%",
                f"{run['held_out']:.4f}",
                f"{run['state_bytes'] / 1024:.0f}",
                f"{run['seconds']:.0f}",
            ]
        )
    headers = [
        "optimizer",
        "lr",
        f"final loss (last {args.tail})",
        "vs its 32-bit form",
        "vs torch AdamW 32-bit",
        "held-out loss",
        "state KiB",
        "train s",
    ]
    png = args.out.with_suffix(".png")
    plot(runs, png, args.tail)
    text = "\n".join(
        [
            f"# Training {args.steps} steps with 8-bit and 32-bit optimizer state",
            "",
            *machine_lines({"model": json.dumps(CONFIG), "batch x context": f"{BATCH} x {CONTEXT}"}),
            "",
            markdown_table(headers, rows),
            "",
            f"Curves: {png.name}",
            "",
        ]
    )
    print(text)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps({name: {k: v for k, v in run.items()} for name, run in runs.items()}, indent=1)
    )
    if not all(math.isfinite(final(run)) for run in runs.values()):
        sys.exit("a run diverged (non-finite loss)")


if __name__ == "__main__":
    main()
