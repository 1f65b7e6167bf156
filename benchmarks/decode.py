"""Greedy decoding on an accelerator (``--device cuda``) or, at small sizes, on the CPU:
tightfit at every storage against transformers and transformers + bitsandbytes on the same
Llama-style model, and the fit at shares of the model's size against accelerate at the same
``max_memory``, in one process and one run.

The model: Llama-style, built from a config with random weights (transformers' own
initialization, seed 0; nothing is downloaded). ``--size 1b`` is TinyLlama's shape (hidden
2048, intermediate 5632, 22 layers, 32 heads and 4 key-value heads, vocabulary 32,000;
1.1B parameters, 2.2 GB in bfloat16); ``--size tiny`` (hidden 128, 2 layers) proves the
script end to end on the CPU in seconds. The model's dtype (``DTYPE``) is bfloat16 at
``1b`` and float32 at ``tiny`` (some CPUs multiply small bfloat16 matrices a hundred times
slower than float32 ones).

Rows, one at a time (built, warmed up with 4 tokens, generated ``--rounds`` times, freed),
so each row's memory is its own:

- ``transformers``: ``model.generate`` (greedy), timed by a streamer;
- ``bnb nf4``, ``bnb 8bit`` (where bitsandbytes imports): every decoder Linear replaced by
  bitsandbytes' ``Linear4bit`` (NF4, blocksize 64, bfloat16 compute) or ``Linear8bitLt``
  (threshold 6.0), as transformers' ``BitsAndBytesConfig`` does (LM head kept), then
  ``model.generate``;
- ``tightfit``, ``tightfit nf4``, ``tightfit 8bit``, ``tightfit int8``: the model as
  built, or ``quantize_`` with the ``tightfit run --quant`` config, the LM head kept as
  bitsandbytes keeps it; ``tightfit float8``: layerwise casting, weights stored in float8
  e4m3 with a scale per output channel, computed in bfloat16 (LM head kept); each generated
  with tightfit's own loop (what ``tightfit run`` times);
- ``tightfit graph``, ``nf4 graph``, ``8bit graph``, ``float8 graph`` (CUDA): the same
  models, decoded by replaying one captured CUDA graph of the step
  (``generate_greedy(..., graph=True)``: a static KV cache, no host work per token);
- ``tightfit budget P%`` (``--budgets``): the model saved as a Hugging Face folder, then
  ``tightfit.load(folder, budget, backend=device)`` with P% of the bfloat16 weights' bytes;
  ``accelerate budget P%``: ``from_pretrained(folder, device_map="auto",
  max_memory={device: budget, "cpu": ...})``.

Every row decodes the same 32 prompt ids into ``--new-tokens`` (128) new tokens without
stopping at an end token. Decode tok/s: the new tokens after the first over the time they
took (median over rounds); TTFT: the prompt's forward. Memory (accelerators): the
allocator's peak during generation and the weights it held before (``max_memory_allocated``,
``memory_allocated``), and the device's whole used memory at the peak (what the driver
reports used before the row, which includes the CUDA context and library workspaces, plus
the allocator's reserved peak); for budget rows the plan's predicted peak beside them.
On the CPU the memory columns are left empty (``benchmarks/fit.py`` measures the CPU).

Run: python benchmarks/decode.py --device cuda --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from _common import as_tightfit_run_threads, markdown_table, module_bytes
from _decoding import Generated, TorchRunner, TransformersRunner, linear_bytes
from torch import nn

import tightfit
from tightfit.app.run import quant_configs
from tightfit.hooks import apply_layerwise_casting
from tightfit.hooks.casting import DEFAULT_SKIP
from tightfit.quant import quantize_

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32),
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4),
}
VOCAB = {"1b": 32000, "tiny": 1000}
DTYPE = {"1b": torch.bfloat16, "tiny": torch.float32}
PROMPT_TOKENS = 32
KEEP = ("lm_head",)  # what BitsAndBytesConfig keeps by default; every row keeps it alike


@dataclass
class Row:
    name: str
    make: Callable[[], TorchRunner]
    figures: dict = field(default_factory=dict)


def build_model(size: str, device: torch.device) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SIZES[size],
        num_key_value_heads=4 if size == "1b" else 2,
        vocab_size=VOCAB[size],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(DTYPE[size]).eval()


def _bnb_linear(model: nn.Module, kind: str, size: str) -> nn.Module:
    """Every decoder Linear as bitsandbytes' layer, quantized on its way to the device."""
    import bitsandbytes as bnb

    device = model.lm_head.weight.device
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or f"{name}.{child_name}".strip(".") in KEEP:
                continue
            weight = child.weight.data.cpu()
            if kind == "nf4":
                layer = bnb.nn.Linear4bit(
                    child.in_features, child.out_features, bias=False, compute_dtype=DTYPE[size], quant_type="nf4"
                )
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                layer = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=False, has_fp16_weights=False, threshold=6.0
                )
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            setattr(module, child_name, layer.to(device))
    return model


def make_rows(args, device: torch.device, folder: Path | None, full_bytes: int) -> list[Row]:
    sync = (lambda: torch.accelerator.synchronize()) if device.type != "cpu" else None

    def ours(model: nn.Module, note: str = "", graph: bool = False) -> TorchRunner:
        return TorchRunner(model, note, synchronize=sync, device=device, graph=graph)

    def theirs(model: nn.Module, note: str = "") -> TransformersRunner:
        bnb = sys.modules.get("bitsandbytes")
        kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt) if bnb else ()
        return TransformersRunner(
            model, note, synchronize=sync, device=device, bytes_per_token=linear_bytes(model, kinds)
        )

    def transformers_bf16() -> TransformersRunner:
        return TransformersRunner(build_model(args.size, device), synchronize=sync, device=device)

    def bnb_row(kind: str) -> Callable[[], TransformersRunner]:
        return lambda: theirs(_bnb_linear(build_model(args.size, device), kind, args.size), f"bitsandbytes {kind}")

    def kept(graph: bool = False) -> Callable[[], TorchRunner]:
        return lambda: ours(build_model(args.size, device), graph=graph)

    def quantized(name: str, graph: bool = False) -> Callable[[], TorchRunner]:
        def make() -> TorchRunner:
            config = replace(quant_configs()[name], skip=KEEP)
            return ours(quantize_(build_model(args.size, device), config), repr(config), graph=graph)

        return make

    def float8(graph: bool = False) -> Callable[[], TorchRunner]:
        def make() -> TorchRunner:
            model = build_model(args.size, device)
            skip = (*DEFAULT_SKIP, *KEEP)
            cast = apply_layerwise_casting(model, torch.float8_e4m3fn, DTYPE[args.size], skip=skip)
            return ours(model, f"{len(cast)} modules cast", graph=graph)

        return make

    def budgeted(share: float) -> Callable[[], TorchRunner]:
        def make() -> TorchRunner:
            budget = int(full_bytes * share)
            ids = torch.tensor([prompt_ids(args.size)])
            model, plan = tightfit.load(folder, budget, backend=str(device), example_inputs={"input_ids": ids})
            runner = ours(model, f"budget {budget / 1e6:.0f} MB; {_plan_summary(plan)}")
            runner.predicted_peak_bytes = plan.predicted_peak_bytes
            runner.budget_bytes = budget
            return runner

        return make

    def accelerate_budgeted(share: float) -> Callable[[], TransformersRunner]:
        def make() -> TransformersRunner:
            from transformers import AutoModelForCausalLM

            budget = int(full_bytes * share)
            where = 0 if device.type == "cuda" else device.type
            max_memory = {where: budget, "cpu": 1 << 40} if device.type != "cpu" else {"cpu": budget}
            model = AutoModelForCausalLM.from_pretrained(
                folder,
                device_map="auto",
                max_memory=max_memory,
                offload_folder=tempfile.mkdtemp(prefix="accelerate-offload-"),
                dtype=DTYPE[args.size],
                local_files_only=True,
            ).eval()
            places = sorted(map(str, set(model.hf_device_map.values())))
            runner = theirs(model, f"budget {budget / 1e6:.0f} MB; device map on {', '.join(places)}")
            runner.budget_bytes = budget
            return runner

        return make

    rows = [Row("transformers", transformers_bf16), Row("tightfit", kept())]
    if _has_bitsandbytes():
        rows += [Row("bnb nf4", bnb_row("nf4")), Row("bnb 8bit", bnb_row("8bit"))]
    rows += [
        Row("tightfit nf4", quantized("nf4")),
        Row("tightfit 8bit", quantized("8bit")),
        Row("tightfit float8", float8()),
    ]
    if device.type == "cuda":
        rows += [
            Row("tightfit graph", kept(graph=True)),
            Row("tightfit nf4 graph", quantized("nf4", graph=True)),
            Row("tightfit 8bit graph", quantized("8bit", graph=True)),
            Row("tightfit float8 graph", float8(graph=True)),
        ]
    for share in args.budgets:
        rows += [
            Row(f"tightfit budget {share:.0%}", budgeted(share)),
            Row(f"accelerate budget {share:.0%}", accelerate_budgeted(share)),
        ]
    rows.append(Row("tightfit int8", quantized("int8")))
    wanted = args.rows
    return [row for row in rows if not wanted or row.name in wanted]


def _has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # not installed, or its native library does not load here
        return False
    return True


def _plan_summary(plan) -> str:
    counts: dict[str, int] = {}
    for entry in plan.entries:
        key = f"{entry.storage}@{entry.placement}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{count} {what}" for what, count in sorted(counts.items(), key=lambda kv: -kv[1]))


def prompt_ids(size: str) -> list[int]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(1, VOCAB[size], (PROMPT_TOKENS,), generator=generator).tolist()


class DeviceMemory:
    """The allocator's and the driver's figures on an accelerator; nothing on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = getattr(torch, device.type) if device.type != "cpu" else None

    def settle(self) -> None:
        gc.collect()
        if self.module is not None:
            self.module.synchronize()
            self.module.empty_cache()

    def used(self) -> int | None:
        """Bytes in use on the whole device, as the driver reports (every process, the context included)."""
        if self.module is None or not hasattr(self.module, "mem_get_info"):
            return None
        free, total = self.module.mem_get_info(self.device)
        return total - free

    def allocated(self) -> int | None:
        return None if self.module is None else self.module.memory_allocated(self.device)

    def reset_peak(self) -> None:
        if self.module is not None:
            self.module.reset_peak_memory_stats(self.device)

    def peaks(self) -> tuple[int | None, int | None]:
        if self.module is None:
            return None, None
        return self.module.max_memory_allocated(self.device), self.module.max_memory_reserved(self.device)


def measure_row(row: Row, ids: list[int], args, memory: DeviceMemory) -> None:
    memory.settle()
    used_before = memory.used()
    reserved_before = None if memory.module is None else memory.module.memory_reserved(memory.device)
    start = time.perf_counter()
    runner = row.make()
    build_seconds = time.perf_counter() - start
    weights = memory.allocated()
    runner.generate(ids, 4)  # warm-up: kernels compiled and caches filled outside the timed rounds
    memory.reset_peak()
    runs: list[Generated] = [runner.generate(ids, args.new_tokens) for _ in range(args.rounds)]
    allocated_peak, reserved_peak = memory.peaks()
    rates = [(len(run.tokens) - 1) / run.decode_seconds for run in runs]
    row.figures = {
        "decode_tokens_per_second": statistics.median(rates),
        "decode_tokens_per_second_min_max": [min(rates), max(rates)],
        "ttft_seconds": statistics.median(run.prefill_seconds for run in runs),
        "build_seconds": build_seconds,
        "bytes_per_token": runner.bytes_per_token,
        "weights_allocated_bytes": weights,
        "allocated_peak_bytes": allocated_peak,
        "device_used_peak_bytes": (None if used_before is None else used_before - reserved_before + reserved_peak),
        "predicted_peak_bytes": getattr(runner, "predicted_peak_bytes", None),
        "budget_bytes": getattr(runner, "budget_bytes", None),
        "tokens": runs[0].tokens,
        "note": runner.note,
    }
    runner.close()
    del runner
    memory.settle()


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def report(rows: list[Row], header: dict) -> str:
    done = [row for row in rows if row.figures]
    base = next((row for row in done if row.name == "transformers" and "error" not in row.figures), None)
    bnb = {row.name.split()[1]: row for row in done if row.name.startswith("bnb ") and "error" not in row.figures}
    table = []
    for row in done:
        f = row.figures
        if "error" in f:
            table.append([row.name, "FAILED: " + f["error"][:100], *[""] * 9])
            continue
        rate = f["decode_tokens_per_second"]
        peer = next((bnb[kind] for kind in bnb if row.name == f"tightfit {kind}"), None)
        table.append(
            [
                row.name,
                f"{rate:.1f}",
                f"{rate / base.figures['decode_tokens_per_second']:.2f}x" if base else "-",
                f"{rate / peer.figures['decode_tokens_per_second']:.2f}x" if peer else "-",
                f"{f['ttft_seconds'] * 1000:.1f}",
                _mb(f["bytes_per_token"]),
                _mb(f["allocated_peak_bytes"]),
                _mb(f["device_used_peak_bytes"]),
                _mb(f["predicted_peak_bytes"]),
                _mb(f["budget_bytes"]),
                str(_same_prefix(f["tokens"], base.figures["tokens"])) if base else "-",
            ]
        )
    lines = [f"- {key}: {value}" for key, value in header.items()]
    headers = [
        "row",
        "decode tok/s",
        "x transformers",
        "x bnb same bits",
        "TTFT ms",
        "weight MB/token",
        "allocator peak MB",
        "device used peak MB",
        "predicted MB",
        "budget MB",
        "same prefix",
    ]
    notes = [f"- {row.name}: {row.figures.get('note', '')}" for row in done if row.figures.get("note")]
    return "\n".join([*lines, "", markdown_table(headers, table), "", *notes]) + "\n"


def _same_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: 1b on an accelerator, else tiny")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budgets", type=lambda text: [float(x) for x in text.split(",") if x], default=[0.5, 0.25])
    parser.add_argument("--rows", nargs="+", default=None, help="only these rows, by name")
    parser.add_argument("--json", type=Path, help="write the figures as JSON here (after every row)")
    parser.add_argument("--markdown", type=Path, help="write the table here (after every row)")
    args = parser.parse_args()
    threads = as_tightfit_run_threads()  # on the CPU, spinning OpenMP threads cost tiny models 50x
    device = torch.device(args.device)
    args.size = args.size or ("tiny" if device.type == "cpu" else "1b")
    memory = DeviceMemory(device)
    header = {
        "device": device.type
        if device.type == "cpu"
        else f"{device.type} {getattr(torch, device.type).get_device_name(device)}",
        "torch": torch.__version__,
        "threading": threads,
        "model": f"Llama-style {args.size}, random weights, {str(DTYPE[args.size]).removeprefix('torch.')}",
        "tokens": f"{PROMPT_TOKENS} prompt ids, {args.new_tokens} new, {args.rounds} rounds (median)",
    }
    with tempfile.TemporaryDirectory(prefix="tightfit-decode-") as scratch:
        folder = None
        model = build_model(args.size, "cpu" if device.type == "cpu" else device)
        full_bytes = module_bytes(model)
        header["parameters"] = f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f}B"
        if args.budgets:
            folder = Path(scratch) / "model"
            model.save_pretrained(folder)
        del model
        rows = make_rows(args, device, folder, full_bytes)
        ids = prompt_ids(args.size)
        for row in rows:
            print(f"{row.name} ...", flush=True)
            try:
                measure_row(row, ids, args, memory)
            except Exception as error:  # one failing row is a finding; the others still run
                row.figures = {"error": f"{type(error).__name__}: {' '.join(str(error).split())}"}
                memory.settle()
            print(f"  {json.dumps({k: v for k, v in row.figures.items() if k != 'tokens'})}", flush=True)
            if args.json:
                args.json.write_text(
                    json.dumps({"header": header, "rows": {r.name: r.figures for r in rows}}, indent=1)
                )
            if args.markdown:
                args.markdown.write_text(report(rows, header))
    print(report(rows, header))


if __name__ == "__main__":
    main()
