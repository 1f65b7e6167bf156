"""A causal LM cut into 1, 2 and 4 pipeline stages at the same total budget (each rank
one share of it), each run with `tightfit stages` under torchrun on gloo (localhost):
tokens/s, every rank's predicted and measured peak against its budget, the seconds each
rank spends in send and receive per generation, and the bytes each rank read while
loading. Beside it, accelerate's `device_map="auto"` in one process with one rank's share
as its `max_memory` (the rest offloaded to disk): on a CPU-only machine accelerate has no
second device, so that is what it does with the same per-device budget.

The model is Llama-style with random weights (this measures memory and time, not
quality): 512 hidden, 12 layers, the default model's 30,522-token vocabulary, float32.

Run: python benchmarks/stages.py [--total 380MB] [--ranks 1 2 4] [--new-tokens 32]
[--no-accelerate] [--out benchmarks/results/stages.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_lines, markdown_table  # noqa: E402

from tightfit._format import human_bytes  # noqa: E402
from tightfit.app.generation_job import DEFAULT_PROMPT  # noqa: E402
from tightfit.app.models import save_causal_lm  # noqa: E402
from tightfit.fitting import parse_size  # noqa: E402

SIZES = dict(
    hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4
)


def run_stages(folder: Path, ranks: int, per_rank: int, new_tokens: int) -> dict:
    tightfit = Path(sys.executable).with_name("tightfit")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += ["--no-python", str(tightfit), "stages", "--model", str(folder), "--budget", str(per_rank)]
    command += ["--max-new-tokens", str(new_tokens), "--repeat", "3", "--json"]
    threads = max(os.cpu_count() // ranks, 1)
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout)


def run_accelerate(folder: Path, per_device: int, new_tokens: int) -> dict:
    """accelerate's device_map in one process: max_memory one rank's share, the rest on disk."""
    script = f"""
import json, time, resource, tempfile, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(folder)!r})
ids = tokenizer({DEFAULT_PROMPT!r}, return_tensors="pt")["input_ids"]
with tempfile.TemporaryDirectory() as offload:
    model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, device_map="auto", max_memory={{"cpu": {per_device}}},
                                                 offload_folder=offload)
    placed = {{str(v) for v in model.hf_device_map.values()}}
    model.generate(ids, max_new_tokens=2, do_sample=False)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens={new_tokens}, min_new_tokens={new_tokens}, do_sample=False)
        times.append(time.perf_counter() - start)
times.sort()
print(json.dumps({{"seconds": times[1], "placed": sorted(placed), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "tokens": out[0, ids.shape[1]:].tolist()}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", default="380MB", help="the total budget, shared equally by the ranks")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "stages.md")
    args = parser.parse_args()
    total = parse_size(args.total, "--total")
    rows, tokens = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = save_causal_lm(Path(scratch) / "lm", **SIZES, seed=0)
        weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        for ranks in args.ranks:
            per_rank = total // ranks
            run = run_stages(folder, ranks, per_rank, args.new_tokens)
            if "error" in run:
                rows.append(
                    [f"tightfit, {ranks} ranks", human_bytes(per_rank), "-", "-", "-", "-", "-", "-", run["error"]]
                )
                continue
            tokens[ranks] = tuple(run["tokens"])
            for report in run["reports"]:
                rows.append(
                    [
                        f"tightfit, {ranks} ranks" if report["rank"] == 0 else "",
                        human_bytes(per_rank),
                        f"{report['rank']}: {report['holds']}",
                        human_bytes(report["predicted_peak_bytes"]),
                        human_bytes(report["measured_peak_bytes"]),
                        human_bytes(report["peak_rss_bytes"]) if report["peak_rss_bytes"] is not None else "-",
                        "yes" if report["within_budget"] else "NO",
                        f"{report['link_seconds'] * 1e3:.1f}",
                        human_bytes(report["read_bytes"]) if report["read_bytes"] is not None else "-",
                        f"{args.new_tokens / run['seconds']:.1f}" if report["rank"] == 0 else "",
                    ]
                )
        if not args.no_accelerate:
            for ranks in args.ranks[1:]:
                per = total // ranks
                result = run_accelerate(folder, per, args.new_tokens)
                if "error" in result:
                    rows.append(
                        ["accelerate device_map (one process)", human_bytes(per), *["-"] * 7, result["error"][:120]]
                    )
                    continue
                rows.append(
                    [
                        "accelerate device_map (one process)",
                        human_bytes(per),
                        f"placed on {', '.join(result['placed'])}",
                        "-",
                        "-",
                        human_bytes(result["peak_rss"]),
                        "-",
                        "-",
                        "-",
                        f"{args.new_tokens / result['seconds']:.1f}",
                    ]
                )
    same = len(set(tokens.values())) <= 1
    lines = [
        "# A causal LM across 1, 2 and 4 ranks at the same total budget",
        "",
        *machine_lines(
            {
                "model": f"Llama-style, {SIZES}, float32, {human_bytes(weights)} of weights",
                "total budget": human_bytes(total),
            }
        ),
        "",
        f"Command: `python benchmarks/stages.py --total {args.total} --ranks {' '.join(map(str, args.ranks))} --new-tokens {args.new_tokens}`",
        "",
        markdown_table(
            [
                "run",
                "budget per rank",
                "rank: holds",
                "predicted",
                "measured",
                "peak RSS",
                "within",
                "ms in send/recv per generation",
                "read while loading",
                "tokens/s",
            ],
            rows,
        ),
        "",
        f"Generated tokens the same for every rank count: {'yes' if same else 'NO'} ({len(tokens)} runs).",
        "Measured: live tensors (weights + created by the run) on each rank. In send/recv: the",
        "seconds a rank spends in point-to-point calls per generation, waiting for its peer",
        "included (the stages run one after another at batch 1). Peak RSS: the whole process (Python,",
        "torch, transformers; for accelerate, the pages of its disk offload too). accelerate's",
        "max_memory bounds the weights it places on a device, not what the process holds.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
