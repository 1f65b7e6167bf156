"""A model bigger than the budget, run as a user runs it: ``tightfit run`` against
transformers + accelerate (``device_map="auto"``) on the same checkpoint, the same prompt
and the same budget.

The checkpoint is a Llama-style causal LM of about 6 GB of bfloat16 weights (41 layers,
hidden 2560, 3.0B parameters; random, seed 0, normal with std 0.02, norms one), written
once, shard by shard and without building the model, into ``--cache-dir`` (default
``~/.cache/tightfit/big-model-6gb``) with the default model's tokenizer; a marker file,
written last, says it is complete. Its names, shapes and dtype are checked against the
skeleton ``tightfit.load`` builds from its config.

For budgets of 50%, 25% and 10% of the weights' bytes, in turn and each in a fresh process:

- tightfit: ``tightfit run --model DIR --budget B --prompt P --max-new-tokens 16 --repeat 1
  --no-reference --json`` (the command a user types; P is 32 tokens). Its JSON gives the
  plan, the predicted and measured peak (the larger of loading, counted in live tensors,
  and generating, the weights held plus the allocator's peak from the profiler), the load
  time, time to first token and decode tokens/s (one timed generation after a warm-up).
- accelerate: ``AutoModelForCausalLM.from_pretrained(DIR, device_map="auto",
  max_memory={"cpu": B}, offload_folder=TMP, dtype=torch.bfloat16)``, then the same greedy
  generation (``tightfit.app.generation.generate_greedy``: a warm-up, one timed run). Its
  measured peak is the larger of the live tensor bytes (``LiveTensorBytes``, the tracker
  tightfit's load figure uses) while loading and while generating once (the weights it
  keeps in memory counted from the start). That is a lower bound: the weights accelerate
  reads from the checkpoint for an offloaded module when it runs come from safetensors,
  outside torch's dispatch, and are not counted. The profiler-based ``allocated_peak`` that
  tightfit's run figure uses is not taken here: it books each safetensors read as an
  allocation of the whole memory-mapped shard (2 GB for a 5 KB tensor, measured), which is
  no memory the process holds. The sampled RSS, anonymous and file-backed, compares both.

Peak RSS: the process's VmHWM, reset before loading (the larger of load and run for
tightfit). "anon" and "file": the most RssAnon and RssFile seen by sampling the process
every 0.2 s. Memory-mapped weights (tightfit maps a unit placed on disk from the checkpoint
in place; transformers maps the shards it loads) are file pages: they count in RSS once
touched, but they are page cache the kernel can reclaim. Load averages before and after
each process are recorded: on a shared machine they explain noisy timings. Targets: tightfit within budget on every row, predicted within 5% of measured,
and at least twice accelerate's decode tokens/s where accelerate offloads to disk.

``--huge``: a 32 GB checkpoint (57 layers, hidden 5120; ``big-model-32gb``), budget 4 GB,
8 new tokens, tightfit only: load time, seconds per token and peak RSS against the
machine's memory. It runs only where the disk has room for the checkpoint.

Run: python benchmarks/big_model.py [--cache-dir DIR] [--out PATH] [--huge]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tightfit._format import human_bytes
from tightfit.app.generation import generate_greedy, generate_seq2seq
from tightfit.app.models import default_model_dir
from tightfit.backends.cpu import _read_kib_fields, read_process_memory, reset_process_peak
from tightfit.kinds import ENCODER_DECODER, kind_of
from tightfit.loading.folder import CAUSAL_LM, skeleton
from tightfit.memory import LiveTensorBytes
from tightfit_launcher import thread_defaults

REPO = Path(__file__).resolve().parent.parent
TIGHTFIT = Path(sys.executable).parent / "tightfit"
CACHE = Path.home() / ".cache" / "tightfit"
MARKER = "tightfit-benchmark-complete.json"
SHARD_BYTES = 2 * 10**9
PROMPT_TOKENS = 32
STORY = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who went out every "
    "morning before dawn and came back every evening with a boat full of silver fish, which his "
    "daughter sold at the market in the square beside the church"
).split()


@dataclass(frozen=True)
class Sizes:
    """A Llama-style checkpoint: its cache folder's name and its config's sizes."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 512
    seed: int = 0


SIX_GB = Sizes("big-model-6gb", 2560, 6912, 41, 20, 4)  # 5.96 GB
THIRTY_TWO_GB = Sizes("big-model-32gb", 5120, 13824, 57, 40, 8)  # 32.0 GB


def _config(sizes: Sizes, tokenizer) -> object:
    from transformers import LlamaConfig

    fields = asdict(sizes)
    del fields["name"], fields["seed"]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **fields,
    )


def _weights_bytes(sizes: Sizes) -> int:
    """The checkpoint's bytes, from its model built on meta."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(sizes, tokenizer))
    return sum(2 * tensor.numel() for tensor in model.state_dict().values())


def _shards(shapes: dict[str, torch.Size]) -> list[list[str]]:
    """Tensor names in checkpoint order, cut into runs of at most SHARD_BYTES (bfloat16)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * shape.numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(folder: Path, sizes: Sizes) -> dict:
    """Write (or reuse, when its marker matches) the checkpoint; returns the marker's content."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    expected = {"sizes": asdict(sizes)}
    marker = folder / MARKER
    if marker.is_file():
        written = json.loads(marker.read_text())
        if written.get("sizes") == expected["sizes"]:
            print(f"reusing {folder} ({human_bytes(written['weights_bytes'])})", flush=True)
            return written
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
    _config(sizes, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, _ = skeleton(folder, CAUSAL_LM)  # on meta: the names and shapes the model expects
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    shards = _shards(shapes)
    generator = torch.Generator().manual_seed(sizes.seed)
    weight_map, total = {}, 0
    for index, names in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        start = time.perf_counter()
        tensors = {}
        for name in names:
            tensor = torch.empty(shapes[name], dtype=torch.bfloat16)
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
            tensors[name] = tensor
            weight_map[name] = file
        save_file(tensors, folder / file, metadata={"format": "pt"})
        shard_bytes = sum(t.nbytes for t in tensors.values())
        total += shard_bytes
        del tensors
        print(f"wrote {file}: {human_bytes(shard_bytes)} in {time.perf_counter() - start:.1f} s", flush=True)
    index_file = folder / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _check_checkpoint(folder, shapes)
    written = {**expected, "weights_bytes": total, "parameters": total // 2, "shards": len(shards)}
    marker.write_text(json.dumps(written, indent=2))  # last: the folder is complete
    return written


def _check_checkpoint(folder: Path, shapes: dict[str, torch.Size]) -> None:
    """Every tensor of the model's skeleton is in the shards' headers, with its shape, in bfloat16, and nothing else."""
    from safetensors import safe_open

    found = {}
    for file in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                found[name] = (tuple(piece.get_shape()), piece.get_dtype())
    wanted = {name: (tuple(shape), "BF16") for name, shape in shapes.items()}
    if found != wanted:
        missing, extra = sorted(wanted.keys() - found.keys()), sorted(found.keys() - wanted.keys())
        wrong = sorted(name for name in wanted.keys() & found.keys() if wanted[name] != found[name])
        raise RuntimeError(
            f"{folder}: checkpoint differs from the skeleton: missing {missing}, extra {extra}, wrong {wrong}"
        )


def build_prompt(folder: Path) -> str:
    """The shortest start of STORY that tokenizes (special tokens included) to PROMPT_TOKENS tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    for count in range(1, len(STORY) + 1):
        text = " ".join(STORY[:count])
        length = len(tokenizer(text).input_ids)
        if length == PROMPT_TOKENS:
            return text
        if length > PROMPT_TOKENS:
            break
    raise RuntimeError(f"no start of the story tokenizes to exactly {PROMPT_TOKENS} tokens")


def _env() -> dict[str, str]:
    """The environment of both subprocesses: the thread defaults that the tightfit command sets for itself."""
    return {**os.environ, **thread_defaults(os.environ)}


#: What the parent samples from a child's /proc/PID/status: its RSS, split into anonymous
#: memory (what the process allocated) and file pages mapped into it (memory-mapped weights:
#: page cache, which the kernel may reclaim).
RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile")


def _subprocess(command: list[str], label: str) -> tuple[dict | None, dict]:
    """Run ``command`` (its stdout is JSON), sampling its RSS every 0.2 s and the load average
    before and after (other processes on the machine slow the timings). Returns (parsed or None, what happened)."""
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {shlex.join(command)}", flush=True)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    peaks = dict.fromkeys(RSS_FIELDS, 0)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        child = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=_env(), cwd=REPO)
        status = Path(f"/proc/{child.pid}/status")
        while child.poll() is None:
            for name, value in _read_kib_fields(status, RSS_FIELDS).items():
                peaks[name] = max(peaks[name], value)
            time.sleep(0.2)
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read(), stderr.read()
    seconds = time.perf_counter() - start
    happened = {
        "command": command,
        "returncode": child.returncode,
        "wall_seconds": seconds,
        "sampled_peak_rss_bytes": peaks["VmRSS"],
        "sampled_peak_rss_anon_bytes": peaks["RssAnon"],
        "sampled_peak_rss_file_bytes": peaks["RssFile"],
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(f"[{time.strftime('%H:%M:%S')}] {label}: exit {child.returncode} after {seconds:.0f} s", flush=True)
    if child.returncode != 0:
        happened["stderr_tail"] = err[-4000:]
        print(err[-4000:], flush=True)
        return None, happened
    try:
        return json.loads(out), happened
    except json.JSONDecodeError as error:
        happened["error"] = f"stdout is not JSON: {error}"
        happened["stdout_tail"] = out[-2000:]
        happened["stderr_tail"] = err[-2000:]
        return None, happened


def _plan_summary(plan: dict) -> dict[str, int]:
    """Units per storage/placement, e.g. {"nf4/device": 30, "keep/disk": 2}."""
    counts: dict[str, int] = {}
    for entry in plan["entries"]:
        key = f"{entry['storage']}/{entry['placement']}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def run_tightfit(
    folder: Path, budget: int, prompt: str, new_tokens: int, options: tuple[str, ...] = (), repeat: int = 1
) -> dict:
    """One ``tightfit run`` as a user types it (``options`` added to its command line), its
    speeds the median of ``repeat`` timed generations; the row's figures and the report
    (plan entries shortened)."""
    command = [str(TIGHTFIT), "run", "--model", str(folder), "--budget", str(budget), "--prompt", prompt]
    command += ["--max-new-tokens", str(new_tokens), "--repeat", str(repeat), "--no-reference", "--json", *options]
    report, happened = _subprocess(command, f"tightfit, budget {human_bytes(budget)}")
    if report is None:
        return {"tool": "tightfit", "ok": False, **happened}
    plan = report["plan"]
    rss = [value for value in (report.get("load_peak_rss_bytes"), report.get("peak_rss_bytes")) if value is not None]
    row = {
        "tool": "tightfit",
        "ok": True,
        "plan": _plan_summary(plan),
        "prompt_tokens": report["prompt_tokens"],
        "new_tokens": report["new_tokens"],
        "predicted_peak_bytes": report["predicted_peak_bytes"],
        "measured_peak_bytes": report["measured_peak_bytes"],
        "within_budget": report["within_budget"],
        "predicted_over_measured": report["predicted_over_measured"],
        "peak_rss_bytes": max(rss) if rss else None,
        "load_seconds": report["load_seconds"],
        "time_to_first_token_s": report["time_to_first_token_ms"] / 1000,
        "decode_tokens_per_second": report["decode_tokens_per_second"],
        "weights_bytes": sum(entry["bytes_after"] for entry in plan["entries"]),  # as stored, wherever they live
        "generated_text": report["generated_text"],
        **happened,
    }
    short = [{k: entry[k] for k in ("module", "storage", "placement", "held_bytes")} for entry in plan["entries"]]
    row["report"] = {**report, "plan": {**{k: v for k, v in plan.items() if k != "entries"}, "entries": short}}
    return row


def run_accelerate(folder: Path, budget: int, prompt: str, new_tokens: int, repeat: int = 1) -> dict:
    """transformers + accelerate in a fresh process (this file's ``--accelerate-worker``), its
    speeds the median of ``repeat`` timed generations."""
    command = [sys.executable, str(Path(__file__).resolve()), "--accelerate-worker", str(folder), str(budget)]
    command += [prompt, str(new_tokens), str(repeat)]
    row, happened = _subprocess(command, f"accelerate, budget {human_bytes(budget)}")
    if row is None:
        return {"tool": "accelerate", "ok": False, **happened}
    row["within_budget"] = row["measured_peak_bytes"] <= budget
    return {"tool": "accelerate", "ok": True, **row, **happened}


def _kept_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct CPU storages of the model's parameters and buffers (offloaded ones are on meta)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def accelerate_worker(folder: str, budget: int, prompt: str, new_tokens: int, repeat: int = 1) -> None:
    """Load with accelerate under ``max_memory={"cpu": budget}``, generate (a warm-up, then
    ``repeat`` timed generations: their median speeds), print the figures as JSON. The
    folder's kind (:mod:`tightfit.kinds`) picks the auto class and the greedy loop."""
    import transformers

    kind = kind_of(transformers.AutoConfig.from_pretrained(folder, local_files_only=True))
    generate = generate_seq2seq if kind.name == ENCODER_DECODER else generate_greedy
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with tempfile.TemporaryDirectory(prefix="accelerate-offload-") as offload:
        reset_process_peak()
        start = time.perf_counter()
        with LiveTensorBytes("cpu") as loading:
            model, info = getattr(transformers, kind.auto_class).from_pretrained(
                folder,
                device_map="auto",
                max_memory={"cpu": budget},
                offload_folder=offload,
                dtype=torch.bfloat16,
                local_files_only=True,
                output_loading_info=True,
            )
        load_seconds = time.perf_counter() - start
        load_rss = read_process_memory()[1]
        if any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")):
            raise RuntimeError(f"the checkpoint does not match the model: {info}")
        model.eval()
        # transformers sets no hf_device_map where it dispatched nothing (all of it in CPU memory)
        placements = list(getattr(model, "hf_device_map", {"": "cpu"}).values())
        kept = _kept_bytes(model)
        generate(model, input_ids, new_tokens)  # warm-up, as tightfit run does
        timings = [generate(model, input_ids, new_tokens) for _ in range(repeat)]  # medians, as tightfit run's
        weights = [t for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"]
        with LiveTensorBytes("cpu", existing=weights) as running:
            generate(model, input_ids, new_tokens)
        peak_rss = read_process_memory()[1]
    counts = {str(place): placements.count(place) for place in sorted(set(map(str, placements)))}
    row = {
        "plan": {f"hf_device_map {place}": count for place, count in counts.items()},
        "offloads_to_disk": "disk" in counts,
        "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": len(timings[-1].tokens),
        "kept_weights_bytes": kept,
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),  # offloaded ones on meta too
        "load_peak_live_bytes": loading.peak,
        "run_peak_live_bytes": running.peak,
        "measured_peak_bytes": max(loading.peak, running.peak),
        "peak_rss_bytes": peak_rss,
        "load_peak_rss_bytes": load_rss,
        "load_seconds": load_seconds,
        "time_to_first_token_s": statistics.median(timed.prefill_seconds for timed in timings),
        "decode_tokens_per_second": statistics.median(timed.decode_tokens_per_second for timed in timings),
        "generated_text": tokenizer.decode(list(timings[-1].tokens), skip_special_tokens=True),
    }
    print(json.dumps(row))


def _cell(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return human_bytes(value)
    if kind == "bool":
        return "yes" if value else "NO"
    return f"{value:{kind}}"


COLUMNS = (
    ("predicted", "predicted_peak_bytes", "bytes"),
    ("measured", "measured_peak_bytes", "bytes"),
    ("fits", "within_budget", "bool"),
    ("pred/meas", "predicted_over_measured", ".3f"),
    ("peak RSS", "peak_rss_bytes", "bytes"),
    ("anon", "sampled_peak_rss_anon_bytes", "bytes"),
    ("file", "sampled_peak_rss_file_bytes", "bytes"),
    ("load s", "load_seconds", ".1f"),
    ("TTFT s", "time_to_first_token_s", ".2f"),
    ("decode tok/s", "decode_tokens_per_second", ".3f"),
)


def print_table(title: str, rows: list[dict]) -> None:
    """One budget's rows, then each row's plan (units per storage/placement, or accelerate's device map)."""
    header = ["tool", *(name for name, _, _ in COLUMNS)]
    lines = [header]
    for row in rows:
        if not row["ok"]:
            lines.append([row["tool"], f"FAILED (exit {row['returncode']})"] + [""] * (len(COLUMNS) - 1))
            continue
        lines.append([row["tool"], *(_cell(row.get(key), kind) for _, key, kind in COLUMNS)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print(f"\n{title}")
    for line in lines:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    for row in rows:
        if row["ok"]:
            plan = ", ".join(f"{key} x{count}" for key, count in row["plan"].items())
            print(f"  {row['tool']} plan: {plan}")
    print(flush=True)


def _repository_state() -> dict:
    """The commit the run used and what in src was changed on top of it (the lead edits while benchmarks run)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "src_changes": git("status", "--short", "--", "src").splitlines()}


def _machine() -> dict:
    import accelerate
    import transformers

    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {
        "cpus": os.cpu_count(),
        "mem_total_bytes": int(meminfo["MemTotal"].split()[0]) * 1024,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


def _write(out: Path, results: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


def six_gb(cache_dir: Path, out: Path) -> dict:
    """tightfit and accelerate, alternating, at 50%, 25% and 10% of the weights' bytes."""
    folder = cache_dir / SIX_GB.name
    checkpoint = write_checkpoint(folder, SIX_GB)
    prompt = build_prompt(folder)
    results = {
        "benchmark": "big_model",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "repository": _repository_state(),
        "machine": _machine(),
        "checkpoint": {"folder": str(folder), **checkpoint},
        "prompt": prompt,
        "rows": [],
    }
    weights = checkpoint["weights_bytes"]
    for fraction in (0.5, 0.25, 0.1):
        budget = int(weights * fraction)
        tightfit_row = run_tightfit(folder, budget, prompt, 16)
        accelerate_row = run_accelerate(folder, budget, prompt, 16)
        ratio = None
        if tightfit_row["ok"] and accelerate_row["ok"] and accelerate_row["decode_tokens_per_second"]:
            ratio = tightfit_row["decode_tokens_per_second"] / accelerate_row["decode_tokens_per_second"]
        results["rows"].append(
            {
                "fraction": fraction,
                "budget_bytes": budget,
                "tightfit": tightfit_row,
                "accelerate": accelerate_row,
                "decode_ratio_tightfit_over_accelerate": ratio,
            }
        )
        print_table(
            f"budget {fraction:.0%} of {human_bytes(weights)} = {human_bytes(budget)}", [tightfit_row, accelerate_row]
        )
        if ratio is not None:
            print(f"  decode tokens/s, tightfit / accelerate: {ratio:.2f}x\n", flush=True)
        _write(out, results)  # after every budget: a run cut short keeps what it measured
    results["targets"] = _targets(results["rows"])
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write(out, results)
    print(json.dumps(results["targets"], indent=2))
    return results


def _targets(rows: list[dict]) -> dict:
    """Each target, met or not, from the rows as measured."""
    tightfit = [row["tightfit"] for row in rows]
    offloading = [row for row in rows if row["accelerate"]["ok"] and row["accelerate"]["offloads_to_disk"]]
    ratios = [row["decode_ratio_tightfit_over_accelerate"] for row in offloading]
    return {
        "tightfit_ran_every_row": all(row["ok"] for row in tightfit),
        "tightfit_within_budget_every_row": all(row["ok"] and row["within_budget"] for row in tightfit),
        "predicted_within_5_percent_every_row": all(
            row["ok"] and abs(row["predicted_over_measured"] - 1) <= 0.05 for row in tightfit
        ),
        "rows_where_accelerate_offloads_to_disk": [row["fraction"] for row in offloading],
        "decode_ratios_where_accelerate_offloads": ratios,
        "at_least_2x_where_accelerate_offloads": bool(ratios) and all(r is not None and r >= 2 for r in ratios),
    }


def huge(cache_dir: Path, out: Path) -> dict | None:
    """32 GB of weights under a 4 GB budget, tightfit only; skipped where the disk has no room."""
    folder = cache_dir / THIRTY_TWO_GB.name
    needed = 0 if (folder / MARKER).is_file() else int(_weights_bytes(THIRTY_TWO_GB) * 1.05)
    existing = next(path for path in (cache_dir, *cache_dir.parents) if path.exists())
    free = shutil.disk_usage(existing).free
    if free < needed + 10 * 10**9:  # room left for offload files and the rest of the machine
        print(
            f"--huge skipped: {human_bytes(free)} free on the disk, the checkpoint needs {human_bytes(needed)} + 10 GB"
        )
        return None
    checkpoint = write_checkpoint(folder, THIRTY_TWO_GB)
    prompt = build_prompt(folder)
    budget = 4 * 10**9
    results = {
        "benchmark": "big_model --huge",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "repository": _repository_state(),
        "machine": _machine(),
        "checkpoint": {"folder": str(folder), **checkpoint},
        "prompt": prompt,
        "budget_bytes": budget,
    }
    row = run_tightfit(folder, budget, prompt, 8)
    if row["ok"]:
        rate = row["decode_tokens_per_second"]
        row["seconds_per_token"] = 1 / rate if rate else None
        row["peak_rss_over_mem_total"] = row["peak_rss_bytes"] / results["machine"]["mem_total_bytes"]
    results["tightfit"] = row
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write(out, results)
    print_table(f"--huge: {human_bytes(checkpoint['weights_bytes'])} of weights, budget {human_bytes(budget)}", [row])
    if row["ok"]:
        print(
            f"  {row['seconds_per_token']:.1f} s per token; peak RSS {human_bytes(row['peak_rss_bytes'])} of "
            f"{human_bytes(results['machine']['mem_total_bytes'])} ({row['peak_rss_over_mem_total']:.0%})"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=CACHE, help=f"where the checkpoints live (default: {CACHE})")
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/big_model[_huge].json)")
    parser.add_argument("--huge", action="store_true", help="the 32 GB checkpoint, budget 4 GB, tightfit only")
    parser.add_argument(
        "--accelerate-worker",
        nargs=5,
        metavar=("DIR", "BUDGET", "PROMPT", "NEW_TOKENS", "REPEAT"),
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.accelerate_worker:
        folder, budget, prompt, new_tokens, repeat = args.accelerate_worker
        accelerate_worker(folder, int(budget), prompt, int(new_tokens), int(repeat))
        return
    name = "big_model_huge.json" if args.huge else "big_model.json"
    out = args.out or REPO / "benchmarks" / "results" / name
    (huge if args.huge else six_gb)(args.cache_dir.expanduser(), out)


if __name__ == "__main__":
    main()
