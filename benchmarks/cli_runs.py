"""``tightfit run`` as a user types it, on a Llama-style causal LM folder, on any device:
decoding eagerly and replayed from a captured CUDA graph (``--graph``), and within budgets
that hold the whole model and that need offloading. Each run is its own process, its own
``--json`` report; the figures are gathered into one table: decode tokens/s, time to the
first token, the measured peak beside the plan's prediction and the budget, and whether
decoding replayed a graph; on a CUDA device also the device's whole used memory above what
it was before the run (the CUDA context and libraries' workspaces too), sampled every 50 ms.

The folder is saved first (``tightfit.app.models.save_causal_lm``: random weights, seed 0,
the default model's tokenizer; nothing is downloaded): ``--size 1b`` is TinyLlama's shape
in bfloat16 (1.1B parameters), ``--size tiny`` a 2-layer float32 model that proves the
script on the CPU.

Run: python benchmarks/cli_runs.py --device cuda --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _common import markdown_table

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4),
}
DTYPE = {"1b": torch.bfloat16, "tiny": torch.float32}
#: (row, extra options; a budget as a share of the weights' bytes) in the order they run:
#: what no GPU run has measured yet first (a GPU step may run out of time).
VARIANTS = {
    "graph auto": ([], None),
    "budget 50%": ([], 0.5),
    "budget 25%": ([], 0.25),
    "eager": (["--graph", "off"], None),
    "budget 150%": ([], 1.5),
}


def save_folder(size: str, folder: Path) -> int:
    """Save the model; returns its weights' bytes (what budgets are shares of)."""
    from tightfit.app.models import save_causal_lm

    save_causal_lm(folder, **SIZES[size], num_key_value_heads=4 if size == "1b" else 2, dtype=DTYPE[size])
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def _used_bytes(device: str) -> int | None:
    """The device's whole used memory (every process, the driver's figure); None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return total - free


def run_variant(command: list[str], limit: float, device: str) -> dict:
    """One ``tightfit run --json``: its report's figures, or why it gave none. On a CUDA
    device, the device's used memory is sampled while it runs: its peak above what was
    used before (this process's own context) is what the run took from the device in all."""
    start = time.perf_counter()
    before = _used_bytes(device)
    outcome: dict = {}

    def call() -> None:
        try:
            outcome["done"] = subprocess.run(command, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            outcome["done"] = None

    worker = threading.Thread(target=call)
    worker.start()
    peak = before
    while worker.is_alive():
        if before is not None:
            peak = max(peak, _used_bytes(device))
        worker.join(0.05)
    seconds, done = time.perf_counter() - start, outcome["done"]
    if done is None:
        return {"error": f"timed out after {limit:.0f} s", "seconds": seconds}
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": f"exit {done.returncode}: {lines[-1] if lines else ''}", "seconds": seconds}
    data = json.loads(done.stdout)
    keys = (
        "decode_tokens_per_second",
        "time_to_first_token_ms",
        "decode_graph",
        "peak_bytes",
        "memory_source",
        "predicted_peak_bytes",
        "budget_bytes",
        "within_budget",
        "device_weights_bytes",
        "load_seconds",
    )
    used = None if before is None else peak - before
    return {**{key: data.get(key) for key in keys}, "device_used_peak_bytes": used, "seconds": seconds}


def _mb(value: object) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def report(rows: dict[str, dict], header: dict) -> str:
    lines = [f"- {key}: {value}" for key, value in header.items()]
    table = []
    for name, row in rows.items():
        if "error" in row:
            table.append([name, f"FAILED: {row['error'][:160]}", *[""] * 8])
            continue
        rate = row["decode_tokens_per_second"]
        table.append(
            [
                name,
                "-" if rate is None else f"{rate:.1f}",
                "yes" if row["decode_graph"] else "no",
                f"{row['time_to_first_token_ms']:.1f}",
                _mb(row["peak_bytes"]),
                _mb(row["device_used_peak_bytes"]),
                _mb(row["predicted_peak_bytes"]),
                _mb(row["budget_bytes"]),
                {True: "yes", False: "NO", None: "-"}[row["within_budget"]],
                f"{row['seconds']:.0f}",
            ]
        )
    headers = ["run", "decode tok/s", "graph", "TTFT ms", "peak MB", "device used MB", "predicted MB", "budget MB"]
    headers += ["within", "wall s"]
    return "\n".join([*lines, "", markdown_table(headers, table, align="lrlrrrrrlr")]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="the --backend of every run (default: cuda)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 1b on an accelerator, else tiny")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="each run's timed repetitions (default: 3)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--limit-s", type=float, default=120.0, help="seconds each run may take (default: 120)")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here (after every run)")
    parser.add_argument("--markdown", type=Path, help="write the table here (after every run)")
    args = parser.parse_args()
    size = args.size or ("tiny" if args.device == "cpu" else "1b")
    header = {"device": args.device, "model": f"Llama-style {size}, random weights, {DTYPE[size]}"}
    header["tokens"] = f"default prompt, {args.new_tokens} new, {args.repeat} timed repetitions (median)"
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tightfit-cli-runs-") as scratch:
        folder = Path(scratch) / "model"
        weights = save_folder(size, folder)
        header["weights"] = f"{weights / 1e6:,.1f} MB"
        for name in args.variants:
            extra, share = VARIANTS[name]
            command = [sys.executable, "-m", "tightfit_launcher", "run", "--model", str(folder)]
            command += ["--backend", args.device, "--max-new-tokens", str(args.new_tokens)]
            command += ["--repeat", str(args.repeat), "--json", *extra]
            if share is not None:
                command += ["--budget", str(int(weights * share)), "--no-reference"]
            print(f"cli_runs: {name}: {' '.join(command[2:])}", flush=True)
            rows[name] = {
                **run_variant(command, args.limit_s, args.device),
                "command": " ".join(["tightfit", *command[3:]]),
            }
            print(f"  {json.dumps(rows[name])}", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
            if args.markdown:
                args.markdown.write_text(report(rows, header))
    print(report(rows, header))


if __name__ == "__main__":
    main()
