"""The fit planner on this machine, on two models: the default one (all-MiniLM-L6-v2,
embedding the default sentences) and a Llama-style causal LM built from a config (random
weights, ``models.save_causal_lm``, one forward over a prompt). For budgets that are
fractions of what the unchanged model needs: plan with ``tightfit.fit``, apply to a
freshly loaded model, then measure the peak, the latency and the quality.

Measured peak: ``tightfit.memory.measure``'s ``allocated_peak_bytes``: the weights held
on the device (``held_bytes``) plus, on the CPU, the most bytes the allocator held at
once during one call (the profiler's allocation events, which include the buffers a
kernel allocates and frees inside one op), on an accelerator its allocator's peak;
"live" (CPU) is the per-op count of live tensors, which misses those buffers.
"pred/meas" is predicted over measured (target: within 10%); "fits" checks measured <=
budget. Latency is the median over ``--repeat`` rounds in which every planned model of
a workload runs once in turn (after three warm-up rounds), so that load from other
processes hits them alike. Quality: the lowest cosine of the sentence embeddings against
the unchanged model (MiniLM); token agreement (teacher forcing) with the unchanged
model's 16 greedy tokens (causal LM).

Run: OMP_WAIT_POLICY=PASSIVE python benchmarks/fit.py [--models minilm,causal-lm] [--fractions 1,0.6,0.4,0.25]
     [--repeat R] [--threads N] [--remeasure] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import tightfit
from tightfit._format import human_bytes
from tightfit.fitting import calibrate, held_bytes
from tightfit.memory import measure
from tightfit.models import default_model_dir, embed, load_encoder
from tightfit.run import DEFAULT_SENTENCES



PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest where"


class Encoder:
    """all-MiniLM-L6-v2 embedding the default sentences; quality: lowest cosine to the unchanged model."""

    name = "all-MiniLM-L6-v2"
    quality_name = "cosine"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sentences = list(DEFAULT_SENTENCES)

    def load(self) -> tuple[torch.nn.Module, dict]:
        self.model, self.tokenizer = load_encoder(default_model_dir(), self.device)
        batch = dict(self.tokenizer(self.sentences, padding=True, truncation=True, return_tensors="pt"))
        return self.model, batch

    def run(self, model: torch.nn.Module) -> torch.Tensor:
        return embed(model, self.tokenizer, self.sentences, self.device)

    def forward(self, model: torch.nn.Module) -> torch.Tensor:
        return self.run(model)

    def quality(self, model: torch.nn.Module, reference: torch.Tensor) -> float:
        return float((self.run(model) * reference).sum(-1).min())


class CausalLM:
    """A Llama-style causal LM with random weights (``models.save_causal_lm``), a forward
    over a prompt; quality: token agreement with the unchanged model's greedy tokens."""

    name = "Llama-style causal LM"
    quality_name = "agreement"

    def __init__(self, device: torch.device, folder: str) -> None:
        from tightfit.models import save_causal_lm

        self.device = device
        self.folder = save_causal_lm(folder)

    def load(self) -> tuple[torch.nn.Module, dict]:
        from tightfit.models import load_causal_lm

        self.model, tokenizer = load_causal_lm(self.folder, self.device)
        self.ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"].to(self.device)
        return self.model, {"input_ids": self.ids}

    def run(self, model: torch.nn.Module) -> tuple[int, ...]:
        from tightfit.generation import generate_greedy

        return generate_greedy(model, self.ids, 16).tokens

    def forward(self, model: torch.nn.Module) -> object:
        with torch.inference_mode():
            return model(input_ids=self.ids)

    def quality(self, model: torch.nn.Module, reference: tuple[int, ...]) -> float:
        from tightfit.generation import token_agreement

        return token_agreement(model, self.ids, reference)


WORKLOADS = {"minilm": Encoder, "causal-lm": CausalLM}


def bench(workload, fractions: list[float], figures, repeat: int) -> list[dict]:
    """Plan, apply and measure ``workload`` at each fraction of its unchanged peak; then time them in rounds."""
    device = workload.device
    rows, runs = [], []
    full_peak = reference = None
    for fraction in fractions:
        model, example = workload.load()
        if full_peak is None:
            full_peak = tightfit.fit(model, example, 1 << 40, calibration=figures).full_peak_bytes
            reference = workload.run(model)
        budget = int(full_peak * fraction)
        plan = tightfit.fit(model, example, budget, calibration=figures)
        print(f"\n{workload.name}, {fraction:.0%} of {human_bytes(full_peak)}:\n{plan}")
        plan.apply(model)
        held = held_bytes(model, device)
        call = lambda model=model: workload.forward(model)  # noqa: E731
        measured = measure(call, device, repeat=1, baseline_bytes=held)  # also warms the call up
        runs.append(call)
        rows.append({"model": workload.name, "fraction": fraction, "budget_bytes": budget,
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "measured_peak_bytes": measured.allocated_peak_bytes,
                     "live_peak_bytes": measured.peak_bytes, "predicted_weights_bytes": plan.predicted_weights_bytes,
                     "measured_weights_bytes": held, "predicted_seconds": plan.predicted_seconds,
                     "quality_name": workload.quality_name, "quality": workload.quality(model, reference),
                     "int8_outliers": plan.int8_outliers,
                     "changes": sorted({f"{e.storage}/{e.placement}" for e in plan.changed_entries()})})
    seconds: list[list[float]] = [[] for _ in runs]
    for round_index in range(3 + repeat):
        for index, run in enumerate(runs):
            start = time.perf_counter()
            run()
            if round_index >= 3:
                seconds[index].append(time.perf_counter() - start)
    for row, timings in zip(rows, seconds):
        row["median_seconds"] = statistics.median(timings)
    return rows


def table(rows: list[dict]) -> str:
    quality = rows[0]["quality_name"]
    lines = [f"{rows[0]['model']}:",
             f"{'budget':>6}  {'bytes':>10}  {'predicted':>10}  {'measured':>10}  {'pred/meas':>9}  fits  {'live':>10}  "
             f"{'held':>9}  {'latency':>9}  {quality:>9}  changes"]
    for row in rows:
        lines.append(
            f"{row['fraction']:>6.0%}  {row['budget_bytes']:>10}  {row['predicted_peak_bytes']:>10}  {row['measured_peak_bytes']:>10}  "
            f"{row['predicted_peak_bytes'] / row['measured_peak_bytes']:>9.3f}  "
            f"{'yes' if row['measured_peak_bytes'] <= row['budget_bytes'] else 'NO':>4}  {row['live_peak_bytes']:>10}  "
            f"{human_bytes(row['measured_weights_bytes']):>9}  {row['median_seconds'] * 1e3:>6.1f} ms  {row['quality']:>9.5f}  "
            f"{', '.join(row['changes']) or '-'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="minilm,causal-lm", help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--fractions", default="1,0.6,0.4,0.25")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--remeasure", action="store_true", help="calibrate the time model again")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        parser.error(f"--models has {', '.join(unknown)}; accepted: {', '.join(WORKLOADS)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    figures = calibrate("cpu", remeasure=args.remeasure)
    print(f"calibration ({figures.device_name}): matmul {figures.matmul_flops / 1e9:.1f} GFLOP/s, memory "
          f"{figures.device_bandwidth / 1e9:.1f} GB/s, disk {figures.disk_bandwidth / 1e9:.2f} GB/s, measured in "
          f"{figures.measured_seconds:.1f} s")
    fractions = [float(f) for f in args.fractions.split(",")]
    tables = []
    with tempfile.TemporaryDirectory(prefix="tightfit-fit-bench-") as folder:
        for name in names:
            workload = CausalLM(device, folder) if name == "causal-lm" else Encoder(device)
            tables.append(bench(workload, fractions, figures, args.repeat))
    print("\nbytes: budget, predicted and measured peak (weights held + the allocator's peak during one call); live: "
          "weights + the per-op count of live tensors")
    for rows in tables:
        print()
        print(table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([row for rows in tables for row in rows], handle, indent=1)


if __name__ == "__main__":
    main()
