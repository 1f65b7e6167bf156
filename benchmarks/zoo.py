"""Causal LMs of several architectures, each with its peculiarity, run as a user runs them:
``tightfit run --budget`` against transformers + accelerate (``device_map="auto"`` with
``max_memory`` at the same budget) at shares of each model's unplanned peak.

The models are built from transformers configs at sizes this CPU runs in seconds (random
weights, seed 0, saved once as float32 safetensors folders with the default model's
WordPiece tokenizer; nothing is downloaded), under ``--cache-dir``:

- ``llama3-gqa``: Llama-3-style grouped-query attention (8 heads, 2 key-value heads);
- ``qwen2``: attention biases on q, k and v;
- ``gemma2``: tied embeddings, attention and final logit soft-capping, head size apart
  from hidden / heads;
- ``mistral``: sliding-window attention (a window of 64);
- ``phi3``: fused qkv and gate-up projections;
- ``gpt2``: tied embeddings, Conv1D layers;
- ``mixtral-moe``: a mixture of 4 experts per layer, 2 chosen per token, saved with its
  experts stacked as the model holds them (``save_original_format=False``: tightfit does
  not yet stream the per-expert layout that transformers converts on loading);
- ``t5``: an encoder-decoder (relative position biases, a tied embedding shared by the
  encoder, the decoder and the LM head): the prompt is the encoder's input.

The unplanned peak is what ``tightfit fit`` predicts for the unchanged model (the prefill
of the prompt, the KV cache's growth and loading). Each row: the plan in a line (units per
storage/placement), predicted against measured peak over loading and the whole generation,
within the budget or not, time to first token and decode tokens/s; accelerate's row the
same where it runs. Prompt: 128 tokens; 64 new tokens (``--new-tokens``). Speeds are the
median of ``--repeat`` timed generations (3) after a warm-up, in each tool's process; the
tools take turns going first from one budget to the next. Each decode speed is also given
as a fraction of its roof: the machine's read bandwidth (:class:`_common.ReadRoof`, sampled
before the first model and after each) over the bytes a token reads: every parameter but
an input embedding's (one row of it), of a mixture's experts the routed share, each at the
bytes the run stores a parameter in (tightfit's plan: its weights as stored over the
model's parameters; accelerate: bfloat16). The KV cache's reads are left out.

Run: python benchmarks/zoo.py [--models llama3-gqa,gpt2] [--fractions 0.6,0.4,0.25] [--units layers,blocks] [--repeat 3]
(writes benchmarks/results/zoo.json and zoo.md beside it, and prints the rows as they come)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
from _common import ReadRoof
from big_model import _plan_summary, run_accelerate, run_tightfit

from tightfit._format import human_bytes
from tightfit.app.models import default_model_dir
from tightfit.app.run import RunOptions, plan_only

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "tightfit-bench" / "zoo"
MARKER = "tightfit-zoo-complete.json"
PROMPT_TOKENS = 128
ATTENTION = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8)
#: name -> (transformers config class, its settings, the auto class that builds it)
ARCHITECTURES = {
    "llama3-gqa": ("LlamaConfig", dict(ATTENTION, num_key_value_heads=2), "AutoModelForCausalLM"),
    "qwen2": ("Qwen2Config", dict(ATTENTION, num_key_value_heads=2), "AutoModelForCausalLM"),
    "gemma2": (
        "Gemma2Config",
        dict(
            ATTENTION,
            num_key_value_heads=4,
            head_dim=48,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
        "AutoModelForCausalLM",
    ),
    "mistral": ("MistralConfig", dict(ATTENTION, num_key_value_heads=2, sliding_window=64), "AutoModelForCausalLM"),
    "phi3": ("Phi3Config", dict(ATTENTION, num_key_value_heads=8), "AutoModelForCausalLM"),
    "gpt2": ("GPT2Config", dict(n_embd=256, n_layer=6, n_head=8, n_positions=512), "AutoModelForCausalLM"),
    "mixtral-moe": (
        "MixtralConfig",
        dict(ATTENTION, intermediate_size=352, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "AutoModelForCausalLM",
    ),
    "t5": ("T5Config", dict(d_model=256, d_ff=704, num_layers=3, num_heads=8, d_kv=32), "AutoModelForSeq2SeqLM"),
}


def model_folder(name: str, cache: Path) -> Path:
    """The architecture's folder, written once (a marker, written last, says it is complete)."""
    import transformers

    folder = cache / name
    if (folder / MARKER).is_file():
        return folder
    config_class, settings, auto = ARCHITECTURES[name]
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"max_position_embeddings": 512} if "n_positions" not in settings and config_class != "T5Config" else {}),
        **settings,
    )
    if config_class == "T5Config":
        config.decoder_start_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, save_original_format=False)  # MoE experts stacked, as the model holds them
    tokenizer.save_pretrained(folder)
    (folder / MARKER).write_text(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
    return folder


def prompt_text(folder: Path) -> str:
    """Words that the folder's tokenizer makes ``PROMPT_TOKENS`` tokens of, special tokens included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    words = ("the river ran past the mill and on to the sea " * 40).split()
    for count in range(len(words), 0, -1):
        text = " ".join(words[:count])
        if len(tokenizer(text).input_ids) <= PROMPT_TOKENS:
            return text
    raise RuntimeError("no prompt fits")


def unplanned_peak(folder: Path, prompt: str, new_tokens: int) -> tuple[int | None, str]:
    """What ``tightfit fit`` predicts for the unchanged model (None, and why, where it refuses)."""
    try:
        budgeted = plan_only(RunOptions(model=str(folder), budget=1 << 40, prompt=prompt, max_new_tokens=new_tokens))
    except (ValueError, RuntimeError) as error:
        return None, " ".join(str(error).split())[:300]
    return budgeted.plan.full_peak_bytes, ""


def _row_line(row: dict) -> str:
    if not row.get("ok"):
        tail = row.get("stderr_tail") or row.get("error") or ""
        return f"  {row['tool']:<10} FAILED: {' '.join(tail.split())[-300:]}"
    plan = ", ".join(f"{count} {what}" for what, count in row["plan"].items())
    predicted = row.get("predicted_peak_bytes")
    return (
        f"  {row['tool']:<10} within {str(row['within_budget']):<5} measured {human_bytes(row['measured_peak_bytes']):>10}"
        f" predicted {human_bytes(predicted) if predicted else '-':>10}"
        f" TTFT {row['time_to_first_token_s'] * 1000:7.0f} ms  decode {row['decode_tokens_per_second']:7.1f} tok/s"
        f"  plan: {plan}"
    )


def read_per_token(folder: Path) -> tuple[int, int]:
    """(parameters a decode token reads, all parameters) of the folder's model, built on
    meta from its config: every parameter but an input embedding's (a token reads one row
    of it, unless the LM head shares it), and of a mixture's stacked experts the routed
    share (top-k of the experts)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    auto = ARCHITECTURES[folder.name][2]
    with torch.device("meta"):
        model = getattr(transformers, auto).from_config(config)
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    read_by_linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    share = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_local_experts", 1)
    read = total = 0
    for parameter in model.parameters():
        total += parameter.numel()
        if id(parameter) in embedded and id(parameter) not in read_by_linear:
            continue
        read += parameter.numel() * (share if parameter.dim() == 3 else 1)
    return int(read), total


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("" where it does not)."""
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return ""


def _mib(value: int | None) -> str:
    return f"{value / 2**20:.1f}" if value else "-"


def markdown(results: dict) -> str:
    """The run as a page: one row per model, budget and tightfit unit size, accelerate's
    row of the same budget beside it, and what the rows show, counted from them."""
    lines = [
        "# The zoo: causal LMs and an encoder-decoder at shares of their unplanned peak",
        "",
        f"`{results['command']}` ({results['started']} to {results.get('finished', '?')}, {results['cpu']}, "
        f"load average {results.get('loadavg', 0):.2f} at the end; figures in `zoo.json`). Each model is built "
        "from a transformers config (random weights, float32, the default model's 30,522-token vocabulary), "
        f"prompt {PROMPT_TOKENS} tokens, {results['new_tokens']} new tokens; `tightfit run --budget` (with "
        '`--units layers` and `--units blocks`) against transformers + accelerate (`device_map="auto"`, '
        '`max_memory={"cpu": budget}`) at the same budget, each in its own process. Peaks in MiB over loading '
        'and the whole generation; "pred/meas" is tightfit\'s predicted peak over its measured one; TTFT in ms; '
        f"decode in tokens/s, the median of {results.get('repeat', 1)} timed generations, and as a share of its "
        "roof (read bandwidth over the bytes a token reads: every parameter but an input embedding's, a "
        "mixture's routed experts only, at the bytes the run stores a parameter in); the ratio is tightfit's "
        f"decode over accelerate's. Read bandwidth: {results['roof']['described']}.",
        "",
        "| model | budget (MiB) | units | within | measured | pred/meas | TTFT | decode | of roof | accelerate within "
        "| measured | decode | of roof | ratio | tightfit's plan (units) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    bandwidth = results["roof"]["bytes_per_second"]

    def of_roof(row: dict, name: str) -> str:
        """Decode speed over the roof: the bandwidth over the bytes a token reads, the
        parameters it reads (:func:`read_per_token`) at the bytes a parameter is stored in
        (the run's weights as stored over the model's parameters)."""
        read, parameters = results["models"][name]["read_per_token"]
        per_token = read * row["weights_bytes"] / parameters
        return f"{row['decode_tokens_per_second'] * per_token / bandwidth:.0%}"

    ratios_within, ratios_over, predictions, rows, within = [], [], [], 0, 0
    for name, entry in results["models"].items():
        if entry["refused"]:
            lines.append(f"| {name} | - | - | refused: {entry['refused']} |" + " |" * 11)
        by_fraction: dict[float, list[dict]] = {}
        for row in entry["rows"]:
            by_fraction.setdefault(row["fraction"], []).append(row)
        for fraction, found in by_fraction.items():
            peer = next((row for row in found if row["tool"] == "accelerate"), {})
            for row in (row for row in found if row["tool"].startswith("tightfit")):
                budget = f"{fraction:.0%} ({_mib(row['budget_bytes'])})"
                units = row["tool"].split("/", 1)[-1]
                if not row.get("ok"):
                    lines.append(f"| {name} | {budget} | {units} | failed |" + " |" * 11)
                    continue
                rows += 1
                within += bool(row["within_budget"])
                predictions.append(row["predicted_over_measured"])
                ratio = None
                peer_cells = "failed | - | - | - | -"
                if peer.get("ok"):
                    ratio = row["decode_tokens_per_second"] / peer["decode_tokens_per_second"]
                    (ratios_within if peer["within_budget"] else ratios_over).append(ratio)
                    peer_cells = (
                        f"{'yes' if peer['within_budget'] else 'NO'} | {_mib(peer['measured_peak_bytes'])} "
                        f"| {peer['decode_tokens_per_second']:.1f} | {of_roof(peer, name)} | {ratio:.2f}x"
                    )
                plan = ", ".join(f"{count} {what}" for what, count in row["plan"].items())
                lines.append(
                    f"| {name} | {budget} | {units} | {'yes' if row['within_budget'] else 'NO'} "
                    f"| {_mib(row['measured_peak_bytes'])} | {row['predicted_over_measured']:.3f} "
                    f"| {row['time_to_first_token_s'] * 1000:.0f} | {row['decode_tokens_per_second']:.1f} "
                    f"| {of_roof(row, name)} | {peer_cells} | {plan} |"
                )
    close = sum(1 for value in predictions if abs(value - 1) <= 0.03)
    lines += [
        "",
        "Counted from the rows above:",
        "",
        f"- tightfit within the budget: {within} of {rows} rows; predicted over measured "
        f"{min(predictions, default=0):.3f} to {max(predictions, default=0):.3f}, within 3% on {close} rows.",
        f"- Where accelerate stays within the budget: tightfit decodes {_span(ratios_within)} as fast "
        f"({sum(r >= 1 for r in ratios_within)} of {len(ratios_within)} rows at least as fast).",
        f"- Where accelerate is over the budget: tightfit (within it) decodes {_span(ratios_over)} as fast.",
    ]
    return "\n".join(lines) + "\n"


def _span(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}x to {max(ratios):.2f}x" if ratios else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ARCHITECTURES), help="comma-separated, of the names above")
    parser.add_argument("--fractions", default="0.6,0.4,0.25")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--units",
        default="layers,blocks",
        help="tightfit run --units values, each a row of its own (comma-separated; default: layers,blocks)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed generations per run, their median (default: 3)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "zoo.json")
    args = parser.parse_args()
    names = [name for name in args.models.split(",") if name]
    unknown = sorted(set(names) - set(ARCHITECTURES))
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} unknown; known: {', '.join(ARCHITECTURES)}")
    fractions = [float(text) for text in args.fractions.split(",") if text]
    unit_sizes = [text for text in args.units.split(",") if text]
    runners = [
        (f"tightfit/{size}", functools.partial(run_tightfit, options=("--units", size), repeat=args.repeat))
        for size in unit_sizes
    ]
    peer = ("accelerate", functools.partial(run_accelerate, repeat=args.repeat))
    roof = ReadRoof()
    roof.measure()
    results = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_name(),
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
        "command": " ".join(["python", "benchmarks/zoo.py", *sys.argv[1:]]),
        "models": {},
    }
    for name in names:
        folder = model_folder(name, args.cache_dir.expanduser())
        prompt = prompt_text(folder)
        full, refused = unplanned_peak(folder, prompt, args.new_tokens)
        entry = {"unplanned_peak_bytes": full, "refused": refused, "read_per_token": read_per_token(folder), "rows": []}
        results["models"][name] = entry
        print(f"\n{name}: unplanned peak {human_bytes(full) if full else '-'} {refused}", flush=True)
        for turn, fraction in enumerate(fractions if full else []):
            budget = int(full * fraction)
            for tool, runner in [*runners, peer] if turn % 2 == 0 else [peer, *runners]:
                row = runner(folder, budget, prompt, args.new_tokens)
                row.update(tool=tool, fraction=fraction, budget_bytes=budget)
                if tool.startswith("tightfit") and row.get("ok"):
                    row["plan"] = row["plan"] if isinstance(row["plan"], dict) else _plan_summary(row["plan"])
                row.pop("report", None)
                entry["rows"].append(row)
                print(f" {fraction:.0%} of it, {human_bytes(budget)}:\n{_row_line(row)}", flush=True)
        roof.measure()
        results["roof"] = {"bytes_per_second": roof.bandwidth, "described": roof.describe()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["loadavg"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))


if __name__ == "__main__":
    main()
