"""The GPU check: one command that, within a time budget, runs the tests that skip without a
GPU, then the per-op and decode benchmarks on the device, and writes every figure as JSON
and a markdown table into ``--out``. GPU time comes rarely and briefly, so everything here
is proven first on the CPU (``--device cpu``: small sizes, the Triton kernels under
Triton's interpreter where Triton is installed); the GPU only measures.

Steps, each in its own process under its own time limit (a step that fails or runs out of
time is recorded and the next one runs):

1. prerequisites: one line naming what is there and what is missing (a missing required
   module stops the check with exit status 2);
2. tests: the Triton kernels against the reference kernels, offloading, and every test
   whose name says CUDA in the graph, memory, fitting and loading suites (on the CPU they
   run or skip as they would in the ordinary suite);
3. ``benchmarks/layer_calls.py``: one quantized layer's one-token forward, per call: the
   host's and the device's time, whether it took the direct path, and the host's most
   costly functions (what eager decoding pays about 150 times a token);
4. ``benchmarks/cli_runs.py``: ``tightfit run`` as a user types it on a 1.1B causal LM
   folder: eager and captured-graph decoding, budgets that hold the model and that need
   offloading, each run's peak beside its prediction and the device's whole used memory;
5. ``benchmarks/decode.py``: decoding at every storage (eager, and replayed from a captured
   CUDA graph) against transformers and transformers + bitsandbytes, and the fit at 50%
   and 25% against accelerate;
6. ``benchmarks/quant.py``: each op per call against bitsandbytes and a copy;
7. ``benchmarks/optim.py``: each 8-bit optimizer's step, paged state included;
8. ``benchmarks/train_fit.py``: the training fit at shares of a step's unplanned peak, full
   fine-tune and QLoRA (activations offloaded, state paged where the plan takes them),
   predicted against the allocator's peak.

Results: ``summary.json`` (each step's command, exit status, seconds, and whether it ran
out of time), ``summary.md`` (the tables), and each step's own files and log.
A folder ``gpu-bundle`` next to ``src`` (``scripts/gpu_bundle.py``) supplies the
modules a machine without network lacks.

Run: python scripts/gpu_check.py --out DIR [--device cpu] [--budget-s 400]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIRED = ("torch", "transformers", "accelerate", "pytest", "hypothesis", "rich")
OPTIONAL = ("triton", "bitsandbytes")
GPU_TEST_FILES = (
    "tests/ops/test_triton_blockwise.py",
    "tests/ops/test_triton_optimizer.py",
    "tests/optim/test_optimizers.py",
    "tests/hooks/test_offload.py",
    "tests/graph/test_schedules.py",
    "tests/graph/test_alloc_run.py",
    "tests/graph/test_compile_backend.py",
    "tests/graph/test_assign.py",
    "tests/memory/test_plan_memory.py",
    "tests/memory/test_allocator.py",
    "tests/fitting/test_arguments.py",
    "tests/loading/test_save.py",
    "tests/app/test_captured.py",
    "tests/ops/test_int8_int_mm.py",
    "tests/quant/test_direct_path_gpu.py",
)
GPU_TEST_SELECTION = "cuda or gpu or triton or offload"

#: Each step's time limit in seconds, per device kind, in the order the steps run.
LIMITS = {
    "cuda": {"tests": 100, "calls": 40, "cli": 200, "decode": 300, "quant": 60, "optim": 60, "train": 90, "stages": 60},
    "cpu": {"tests": 240, "calls": 60, "cli": 120, "decode": 240, "quant": 120, "optim": 120, "train": 120, "stages": 60},
}


def environment() -> dict[str, str]:
    """The child processes' environment: tightfit from ``src``, then the bundle, if there."""
    paths = [str(REPO / "src")]
    bundle = REPO / "gpu-bundle"
    if bundle.is_dir():
        paths.append(str(bundle))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE": "1"}


def prerequisites(device: str) -> tuple[list[str], list[str]]:
    """(what is there, with versions; what is missing) for this device."""
    sys.path[:0] = environment()["PYTHONPATH"].split(os.pathsep)
    there, missing = [], []
    for name in (*REQUIRED, *OPTIONAL):
        try:
            module = importlib.import_module(name)
        except Exception as error:  # absent, or present but broken (a native library that does not load)
            missing.append(name if name in REQUIRED else f"{name} (optional: {type(error).__name__})")
            continue
        there.append(f"{name} {getattr(module, '__version__', '?')}")
    import torch

    if device != "cpu":
        kind = torch.device(device).type
        backend = getattr(torch, kind, None)
        if backend is None or not backend.is_available():
            missing.append(f"a {kind} device")
        else:
            there.append(f"{backend.get_device_name()} ({getattr(torch.version, kind, None) or '?'})")
    return there, missing


def run_step(name: str, command: list[str], limit: float, out: Path, env: dict[str, str]) -> dict:
    """Run one step with its output in ``out/<name>.log``; never raises for the step's failure."""
    log = out / f"{name}.log"
    start = time.perf_counter()
    print(f"gpu-check: {name} (at most {limit:.0f} s): {' '.join(command)}", flush=True)
    with log.open("w") as file:
        try:
            status = subprocess.run(command, cwd=REPO, env=env, stdout=file, stderr=subprocess.STDOUT, timeout=limit)
            returncode, timed_out = status.returncode, False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
    seconds = time.perf_counter() - start
    tail = log.read_text(errors="replace").splitlines()[-3:]
    print(f"gpu-check: {name}: exit {returncode}{' (timed out)' if timed_out else ''} in {seconds:.0f} s", flush=True)
    return {"command": command, "returncode": returncode, "timed_out": timed_out, "seconds": seconds, "tail": tail}


def steps(device: str, out: Path) -> list[tuple[str, list[str], Path | None]]:
    """(name, command, its markdown output) in the order they run."""
    python = sys.executable
    cpu = device == "cpu"
    tests = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={out / 'tests.xml'}"]
    tests += ["-k", GPU_TEST_SELECTION, *GPU_TEST_FILES]
    quant = [python, "benchmarks/quant.py", "--device", device, "--json", str(out / "quant.json")]
    quant += ["--numel", str(1 << 16), "--repeat", "1", "--only", "blockwise"] if cpu else []
    calls = [python, "benchmarks/layer_calls.py", "--device", device]
    calls += ["--json", str(out / "calls.json"), "--markdown", str(out / "calls.md")] + (
        ["--calls", "50"] if cpu else []
    )
    cli = [python, "benchmarks/cli_runs.py", "--device", device]
    cli += ["--json", str(out / "cli.json"), "--markdown", str(out / "cli.md")]
    cli += ["--new-tokens", "6", "--repeat", "1", "--variants", "budget 50%"] if cpu else []
    decode = [python, "benchmarks/decode.py", "--device", device, "--rounds", "1"]
    decode += ["--json", str(out / "decode.json"), "--markdown", str(out / "decode.md")]
    if cpu:
        decode += ["--size", "tiny", "--new-tokens", "6", "--budgets", "0.5"]
        decode += ["--rows", "transformers", "tightfit", "tightfit nf4", "tightfit budget 50%", "accelerate budget 50%"]
    optim = [python, "benchmarks/optim.py", "--device", device, "--out", str(out / "optim.md")]
    optim += (
        ["--sizes", "64K", "--rounds", "1", "--rules", "Adam"] if cpu else ["--sizes", "16M", "128M", "--rounds", "3"]
    )
    train = [python, "benchmarks/train_fit.py", "--device", device, "--no-torch", "--out", str(out / "train_fit.md")]
    tiny = ["--size", "tiny", "--batch", "2", "--seq", "32", "--shares", "0.6", "--steps", "1"]
    train += tiny if cpu else ["--shares", "0.5", "0.3", "--steps", "2"]
    stages = [python, "benchmarks/stages.py", "--out", str(out / "stages.md")]
    stages += (
        ["--devices", "cpu", "--size", "tiny", "--total", "40MB", "--new-tokens", "4", "--no-accelerate"]
        if cpu
        else ["--devices", "cuda:0", "cpu", "--total", "380MB", "--new-tokens", "32"]
    )
    return [
        ("tests", tests, None),
        ("calls", calls, out / "calls.md"),
        ("cli", cli, out / "cli.md"),
        ("decode", decode, out / "decode.md"),
        ("quant", quant, out / "quant.log"),
        ("optim", optim, out / "optim.md"),
        ("train", train, out / "train_fit.md"),
        ("stages", stages, out / "stages.md"),
    ]


def _test_counts(xml: Path) -> str:
    import xml.etree.ElementTree as ElementTree

    if not xml.is_file():
        return "no report"
    suite = ElementTree.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    line = f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    return "\n".join([line, *(f"- failed: {name}" for name in failed)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the results (made if absent)")
    parser.add_argument("--device", default="cuda", help="cuda (default), another accelerator, or cpu (small sizes)")
    parser.add_argument("--budget-s", type=float, default=400.0, help="seconds for all steps together (default 400)")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=("tests", "calls", "cli", "quant", "decode"), help="steps left out"
    )
    args = parser.parse_args()
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    there, missing = prerequisites(args.device)
    required_missing = [name for name in missing if "optional" not in name]
    print(f"gpu-check: {'ready' if not required_missing else 'NOT READY'}: have {', '.join(there)}", end="")
    print(f"; missing: {', '.join(missing)}" if missing else "", flush=True)
    if required_missing:
        return 2
    env = environment()
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels' tests run under the interpreter
    kind = "cpu" if args.device == "cpu" else "cuda"
    deadline = time.perf_counter() + args.budget_s
    summary = {"device": args.device, "have": there, "missing": missing, "steps": {}}
    sections = []
    for name, command, markdown in steps(args.device, out):
        limit = LIMITS[kind][name]
        if name in args.skip:
            continue
        left = deadline - time.perf_counter()
        if left < 10:
            summary["steps"][name] = {"command": command, "skipped": "no time left in --budget-s"}
            continue
        result = run_step(name, command, min(limit, left), out, env)
        summary["steps"][name] = result
        body = _test_counts(out / "tests.xml") if name == "tests" else ""
        if markdown is not None and markdown.is_file():
            body = markdown.read_text(errors="replace")
        status = "timed out" if result["timed_out"] else f"exit {result['returncode']}"
        sections.append(f"## {name} ({status}, {result['seconds']:.0f} s)\n\n{body.strip()}\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "summary.md").write_text("\n".join(sections))
    print("\n".join(sections))
    failed = [
        name
        for name, step in summary["steps"].items()
        if step.get("returncode") not in (0, None) or step.get("timed_out")
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
