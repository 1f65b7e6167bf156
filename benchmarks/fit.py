"""The fit planner on the default model (all-MiniLM-L6-v2) on this machine: for budgets
that are fractions of what the unchanged model needs, plan with ``tightfit.fit``, apply,
then measure the peak (weights held on the device + live tensor bytes of the run, as
``tightfit.memory.measure`` counts them on the CPU), the latency and the lowest cosine
of the sentence embeddings against the unchanged model. With ``--causal-lm``: a
Llama-style causal LM built from a config (random weights, ``models.save_causal_lm``),
planned and measured on a forward over a prompt; latency is that forward; quality is
token agreement (teacher forcing) with the unchanged model's 16 greedy tokens.

Each budget starts from a freshly loaded model. "pred/meas" is predicted peak over
measured peak (target: within 10%); "fits" checks measured <= budget. Latency is the
median over ``--repeat`` rounds in which every planned model runs once in turn (after
three warm-up rounds), so that load from other processes hits them alike.

Run: python benchmarks/fit.py [--causal-lm] [--fractions 1,0.6,0.4,0.25] [--repeat R] [--threads N] [--remeasure] [--json PATH]
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

    def quality(self, model: torch.nn.Module, reference: torch.Tensor) -> float:
        return float((self.run(model) * reference).sum(-1).min())


class CausalLM:
    """A Llama-style causal LM with random weights (``models.save_causal_lm``), a forward
    over a prompt; quality: token agreement with the unchanged model's greedy tokens."""

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="1,0.6,0.4,0.25")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--remeasure", action="store_true", help="calibrate the time model again")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--causal-lm", action="store_true", help="a Llama-style causal LM built from a config instead")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    figures = calibrate("cpu", remeasure=args.remeasure)
    print(f"calibration ({figures.device_name}): matmul {figures.matmul_flops / 1e9:.1f} GFLOP/s, memory "
          f"{figures.device_bandwidth / 1e9:.1f} GB/s, disk {figures.disk_bandwidth / 1e9:.2f} GB/s, measured in "
          f"{figures.measured_seconds:.1f} s")
    with tempfile.TemporaryDirectory(prefix="tightfit-fit-bench-") as folder:
        workload = CausalLM(device, folder) if args.causal_lm else Encoder(device)
        rows, runs = [], []
        full_peak = reference = None
        for fraction in (float(f) for f in args.fractions.split(",")):
            model, example = workload.load()
            if full_peak is None:
                full_peak = tightfit.fit(model, example, 1 << 40, calibration=figures).full_peak_bytes
                reference = workload.run(model)
            budget = int(full_peak * fraction)
            plan = tightfit.fit(model, example, budget, calibration=figures)
            print(f"\n{fraction:.0%} of {human_bytes(full_peak)}:\n{plan}")
            plan.apply(model)
            held = held_bytes(model, device)
            call = (lambda model=model: workload.forward(model)) if args.causal_lm else (lambda model=model: workload.run(model))
            result = measure(call, device, repeat=1, baseline_bytes=held)
            runs.append(call)
            rows.append({"fraction": fraction, "budget_bytes": budget, "predicted_peak_bytes": plan.predicted_peak_bytes,
                         "measured_peak_bytes": result.peak_bytes, "predicted_weights_bytes": plan.predicted_weights_bytes,
                         "measured_weights_bytes": held, "predicted_seconds": plan.predicted_seconds,
                         "quality": workload.quality(model, reference),
                         "changes": sorted({f"{e.storage}/{e.placement}" for e in plan.changed_entries()})})
    seconds: list[list[float]] = [[] for _ in runs]
    for round_index in range(3 + args.repeat):
        for index, run in enumerate(runs):
            start = time.perf_counter()
            run()
            if round_index >= 3:
                seconds[index].append(time.perf_counter() - start)
    for row, timings in zip(rows, seconds):
        row["median_seconds"] = statistics.median(timings)
    print(f"\n{'budget':>6}  {'bytes':>9}  {'predicted':>9}  {'measured':>9}  {'pred/meas':>9}  fits  {'held pred':>9}  "
          f"{'held meas':>9}  {'latency':>9}  {'pred time':>9}  {workload.quality_name:>9}  changes")
    for row in rows:
        print(f"{row['fraction']:>6.0%}  {human_bytes(row['budget_bytes']):>9}  {human_bytes(row['predicted_peak_bytes']):>9}  "
              f"{human_bytes(row['measured_peak_bytes']):>9}  {row['predicted_peak_bytes'] / row['measured_peak_bytes']:>9.3f}  "
              f"{'yes' if row['measured_peak_bytes'] <= row['budget_bytes'] else 'NO':>4}  "
              f"{human_bytes(row['predicted_weights_bytes']):>9}  {human_bytes(row['measured_weights_bytes']):>9}  "
              f"{row['median_seconds'] * 1e3:>6.1f} ms  {row['predicted_seconds'] * 1e3:>6.1f} ms  {row['quality']:>9.5f}  "
              f"{', '.join(row['changes']) or '-'}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
