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

A third workload, ``--models activations``, is a synthetic attention stack whose
activations (batch 8 x 256 tokens, the attention scores materialized) are about 25 times its
weights: below its unchanged peak no storage or placement meets the budget, so ``fit``
slices each layer over the batch (DFS hints). Those plans run as ``plan.compile(model)``
(the tightfit backend, FX execution); the measured peak is the weights held, plus the
input (512 KiB here, on the device during the call; the plan counts it), plus
``tightfit.memory.allocated_peak`` of one compiled call (what ``measure`` reports as
``allocated_peak_bytes``, called directly: ``measure``'s live-tensor call enters a dispatch
mode that sends dynamo back to eager for later calls); "live" is ``compiled_peak``, the
per-op count of the compiled call's live tensors, with the same weights and input. A plan
without hints (the budget covers the model) predicts an eager call and runs eagerly,
measured with ``measure``. Latency: the hinted plan compiled,
against the same model compiled without hints and run eagerly, in rounds as above.

Run: OMP_WAIT_POLICY=PASSIVE python benchmarks/fit.py [--models minilm,causal-lm,activations] [--fractions 1,0.6,0.4,0.25]
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
from tightfit.app.models import default_model_dir, embed, load_encoder
from tightfit.app.run import DEFAULT_SENTENCES
from tightfit.fitting import calibrate, held_bytes
from tightfit.memory import measure

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest where"


def median_seconds_in_rounds(runs: list, repeat: int, warmup: int = 3) -> list[float]:
    """Each run's median seconds over ``repeat`` rounds in which every run goes once in turn
    (after ``warmup`` rounds), so that load from other processes hits them alike."""
    seconds: list[list[float]] = [[] for _ in runs]
    for round_index in range(warmup + repeat):
        for index, run in enumerate(runs):
            start = time.perf_counter()
            run()
            if round_index >= warmup:
                seconds[index].append(time.perf_counter() - start)
    return [statistics.median(timings) for timings in seconds]


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
        from tightfit.app.models import save_causal_lm

        self.device = device
        self.folder = save_causal_lm(folder)

    def load(self) -> tuple[torch.nn.Module, dict]:
        from tightfit.app.models import load_causal_lm

        self.model, tokenizer = load_causal_lm(self.folder, self.device)
        self.ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"].to(self.device)
        return self.model, {"input_ids": self.ids}

    def run(self, model: torch.nn.Module) -> tuple[int, ...]:
        from tightfit.app.generation import generate_greedy

        return generate_greedy(model, self.ids, 16).tokens

    def forward(self, model: torch.nn.Module) -> object:
        with torch.inference_mode():
            return model(input_ids=self.ids)

    def quality(self, model: torch.nn.Module, reference: tuple[int, ...]) -> float:
        from tightfit.app.generation import token_agreement

        return token_agreement(model, self.ids, reference)


class AttentionLayer(torch.nn.Module):
    """Pre-norm attention (scores materialized) and an MLP, with residuals."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) * (width // self.heads) ** -0.5
        x = x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, width))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class AttentionStack(torch.nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(AttentionLayer() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _attention_stack() -> AttentionStack:
    torch.manual_seed(0)
    return AttentionStack().eval()


def bench_activations(fractions: list[float], figures, repeat: int) -> list[dict]:
    """Plan a fresh attention stack at each fraction of its unchanged peak, apply, compile, measure; then time in rounds."""
    from tightfit.memory import allocated_peak
    from tightfit.memory.compiled import compiled_peak

    x = torch.randn(8, 256, 64, generator=torch.Generator().manual_seed(1))
    eager = _attention_stack()
    plain = torch.compile(
        _attention_stack(), backend=tightfit.graph.compiler(execution="fx")
    )  # the same weights, no hints
    full_peak = tightfit.fit(eager, (x,), 1 << 40, calibration=figures).full_peak_bytes
    with torch.inference_mode():
        reference = eager(x)
    rows, runs = [], []
    for fraction in fractions:
        model = _attention_stack()
        budget = int(full_peak * fraction)
        plan = tightfit.fit(model, (x,), budget, calibration=figures)
        print(f"\nattention stack, {fraction:.0%} of {human_bytes(full_peak)}:\n{plan}")
        plan.apply(model)
        held, inputs = held_bytes(model, "cpu"), x.untyped_storage().nbytes()
        if plan.runtime == "compiled":
            compiled = plan.compile(model)
            call = lambda compiled=compiled: compiled(x)  # noqa: E731
            with torch.inference_mode():
                same = torch.allclose(call(), reference, atol=1e-5)  # compiles, and warms up
                measured = held + inputs + allocated_peak(call)
                live = held + inputs + compiled_peak(call)
        else:  # the plan's prediction is for eager calls: run it so
            call = lambda model=model: model(x)  # noqa: E731
            with torch.inference_mode():
                same = torch.allclose(call(), reference, atol=1e-5)
                found = measure(call, "cpu", repeat=1, baseline_bytes=held + inputs)
            measured, live = found.allocated_peak_bytes, found.peak_bytes
        runs.append(call)
        slices = next(iter(plan.hints.values()))["slices"] if plan.hints else 0
        rows.append(
            {
                "model": "attention stack",
                "fraction": fraction,
                "budget_bytes": budget,
                "slices": slices,
                "runtime": plan.runtime,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": measured,
                "live_peak_bytes": live,
                "predicted_weights_bytes": plan.predicted_weights_bytes,
                "measured_weights_bytes": held,
                "same_output": same,
                "changes": sorted({f"{e.storage}/{e.placement}" for e in plan.changed_entries()}),
            }
        )
    runs += [lambda: plain(x), lambda: eager(x)]
    with torch.inference_mode():
        medians = median_seconds_in_rounds(runs, repeat)
    plain_seconds, eager_seconds = medians[-2:]
    for row, median in zip(rows, medians):
        row.update(median_seconds=median, compiled_unhinted_seconds=plain_seconds, eager_seconds=eager_seconds)
    return rows


def activations_table(rows: list[dict]) -> str:
    lines = [
        "attention stack (batch 8 x 256 tokens, 4 layers, width 64; plans with slices run as plan.compile(model), "
        "FX execution; the others eagerly); measured: weights + input + the allocator's peak during one call",
        f"{'budget':>6}  {'bytes':>10}  {'slices':>6}  {'predicted':>10}  {'measured':>10}  {'pred/meas':>9}  fits  "
        f"{'live':>10}  {'latency':>9}  {'x no hints':>10}  same  changes",
    ]
    for row in rows:
        lines.append(
            f"{row['fraction']:>6.0%}  {row['budget_bytes']:>10}  {row['slices'] or '-':>6}  {row['predicted_peak_bytes']:>10}  "
            f"{row['measured_peak_bytes']:>10}  {row['predicted_peak_bytes'] / row['measured_peak_bytes']:>9.3f}  "
            f"{'yes' if row['measured_peak_bytes'] <= row['budget_bytes'] else 'NO':>4}  {row['live_peak_bytes']:>10}  "
            f"{row['median_seconds'] * 1e3:>6.1f} ms  {row['median_seconds'] / row['compiled_unhinted_seconds']:>9.2f}x  "
            f"{'yes' if row['same_output'] else 'NO'}  {', '.join(row['changes']) or '-'}"
        )
    lines.append(
        f"the same model compiled without hints: {rows[0]['compiled_unhinted_seconds'] * 1e3:.1f} ms; "
        f"eager: {rows[0]['eager_seconds'] * 1e3:.1f} ms"
    )
    return "\n".join(lines)


WORKLOADS = {
    "minilm": Encoder,
    "causal-lm": CausalLM,
    "activations": AttentionStack,
}  # the default: minilm and causal-lm


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
        rows.append(
            {
                "model": workload.name,
                "fraction": fraction,
                "budget_bytes": budget,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": measured.allocated_peak_bytes,
                "live_peak_bytes": measured.peak_bytes,
                "predicted_weights_bytes": plan.predicted_weights_bytes,
                "measured_weights_bytes": held,
                "predicted_seconds": plan.predicted_seconds,
                "quality_name": workload.quality_name,
                "quality": workload.quality(model, reference),
                "int8_outliers": plan.int8_outliers,
                "changes": sorted({f"{e.storage}/{e.placement}" for e in plan.changed_entries()}),
            }
        )
    for row, median in zip(rows, median_seconds_in_rounds(runs, repeat)):
        row["median_seconds"] = median
    return rows


def table(rows: list[dict]) -> str:
    quality = rows[0]["quality_name"]
    lines = [
        f"{rows[0]['model']}:",
        f"{'budget':>6}  {'bytes':>10}  {'predicted':>10}  {'measured':>10}  {'pred/meas':>9}  fits  {'live':>10}  "
        f"{'held':>9}  {'latency':>9}  {quality:>9}  changes",
    ]
    for row in rows:
        lines.append(
            f"{row['fraction']:>6.0%}  {row['budget_bytes']:>10}  {row['predicted_peak_bytes']:>10}  {row['measured_peak_bytes']:>10}  "
            f"{row['predicted_peak_bytes'] / row['measured_peak_bytes']:>9.3f}  "
            f"{'yes' if row['measured_peak_bytes'] <= row['budget_bytes'] else 'NO':>4}  {row['live_peak_bytes']:>10}  "
            f"{human_bytes(row['measured_weights_bytes']):>9}  {row['median_seconds'] * 1e3:>6.1f} ms  {row['quality']:>9.5f}  "
            f"{', '.join(row['changes']) or '-'}"
        )
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
    print(
        f"calibration ({figures.device_name}): matmul {figures.matmul_flops / 1e9:.1f} GFLOP/s, memory "
        f"{figures.device_bandwidth / 1e9:.1f} GB/s, disk {figures.disk_bandwidth / 1e9:.2f} GB/s, measured in "
        f"{figures.measured_seconds:.1f} s"
    )
    fractions = [float(f) for f in args.fractions.split(",")]
    tables = []
    with tempfile.TemporaryDirectory(prefix="tightfit-fit-bench-") as folder:
        for name in names:
            if name == "activations":
                tables.append(bench_activations(fractions, figures, args.repeat))
                continue
            workload = CausalLM(device, folder) if name == "causal-lm" else Encoder(device)
            tables.append(bench(workload, fractions, figures, args.repeat))
    print(
        "\nbytes: budget, predicted and measured peak (weights held + the allocator's peak during one call); live: "
        "weights + the per-op count of live tensors"
    )
    for rows in tables:
        print()
        print(activations_table(rows) if rows[0]["model"] == "attention stack" else table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([row for rows in tables for row in rows], handle, indent=1)


if __name__ == "__main__":
    main()
