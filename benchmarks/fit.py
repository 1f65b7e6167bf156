"""The fit planner on the default model (all-MiniLM-L6-v2) on this machine: for budgets
that are fractions of what the unchanged model needs, plan with ``tightfit.fit``, apply,
then measure the peak (weights held on the device + live tensor bytes of the run, as
``tightfit.memory.measure`` counts them on the CPU), the latency and the lowest cosine
of the sentence embeddings against the unchanged model.

Each budget starts from a freshly loaded model. "pred/meas" is predicted peak over
measured peak (target: within 10%); "fits" checks measured <= budget. Latency is the
median over ``--repeat`` rounds in which every planned model runs once in turn (after
three warm-up rounds), so that load from other processes hits them alike.

Run: python benchmarks/fit.py [--fractions 1,0.6,0.4,0.25] [--repeat R] [--threads N] [--remeasure] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import tightfit
from tightfit._format import human_bytes
from tightfit.fitting import calibrate, held_bytes
from tightfit.memory import measure
from tightfit.models import default_model_dir, embed, load_encoder
from tightfit.run import DEFAULT_SENTENCES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="1,0.6,0.4,0.25")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--remeasure", action="store_true", help="calibrate the time model again")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    sentences = list(DEFAULT_SENTENCES)
    figures = calibrate("cpu", remeasure=args.remeasure)
    print(f"calibration ({figures.device_name}): matmul {figures.matmul_flops / 1e9:.1f} GFLOP/s, memory "
          f"{figures.device_bandwidth / 1e9:.1f} GB/s, disk {figures.disk_bandwidth / 1e9:.2f} GB/s, measured in "
          f"{figures.measured_seconds:.1f} s")
    rows, runs = [], []
    full_peak = None
    for fraction in (float(f) for f in args.fractions.split(",")):
        model, tokenizer = load_encoder(default_model_dir(), device)
        batch = dict(tokenizer(sentences, padding=True, truncation=True, return_tensors="pt"))
        reference = embed(model, tokenizer, sentences, device)
        if full_peak is None:
            full_peak = tightfit.fit(model, batch, 1 << 40, calibration=figures).full_peak_bytes
        budget = int(full_peak * fraction)
        plan = tightfit.fit(model, batch, budget, calibration=figures)
        print(f"\n{fraction:.0%} of {human_bytes(full_peak)}:\n{plan}")
        plan.apply(model)
        held = held_bytes(model, device)
        result = measure(lambda: embed(model, tokenizer, sentences, device), device, repeat=1, baseline_bytes=held)
        runs.append(lambda model=model, tokenizer=tokenizer: embed(model, tokenizer, sentences, device))
        cosine = float((embed(model, tokenizer, sentences, device) * reference).sum(-1).min())
        rows.append({"fraction": fraction, "budget_bytes": budget, "predicted_peak_bytes": plan.predicted_peak_bytes,
                     "measured_peak_bytes": result.peak_bytes, "predicted_weights_bytes": plan.predicted_weights_bytes,
                     "measured_weights_bytes": held, "predicted_seconds": plan.predicted_seconds,
                     "min_cosine": cosine,
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
          f"{'held meas':>9}  {'latency':>9}  {'pred time':>9}  {'cosine':>8}  changes")
    for row in rows:
        print(f"{row['fraction']:>6.0%}  {human_bytes(row['budget_bytes']):>9}  {human_bytes(row['predicted_peak_bytes']):>9}  "
              f"{human_bytes(row['measured_peak_bytes']):>9}  {row['predicted_peak_bytes'] / row['measured_peak_bytes']:>9.3f}  "
              f"{'yes' if row['measured_peak_bytes'] <= row['budget_bytes'] else 'NO':>4}  "
              f"{human_bytes(row['predicted_weights_bytes']):>9}  {human_bytes(row['measured_weights_bytes']):>9}  "
              f"{row['median_seconds'] * 1e3:>6.1f} ms  {row['predicted_seconds'] * 1e3:>6.1f} ms  {row['min_cosine']:>8.5f}  "
              f"{', '.join(row['changes']) or '-'}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
