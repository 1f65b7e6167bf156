"""Perplexity against the fit planner's expected error: a small Llama-style language model
trained here on Python's own standard-library sources, evaluated on held-out files in
every storage tightfit offers and under the planner's plans at shares of its unplanned
peak, with the default error bound and without one.

Random weights say nothing about quality (their next-token choices are near ties), so the
model learns something first. The corpus is the ``*.py`` files of
``sysconfig.get_paths()["stdlib"]`` (test folders and site-packages left out), sorted by
path; bytes are the tokens (vocabulary 256: nothing to download). Of every ten files in
that order, the first four are training text and the tenth is held out; the others are
not used. The model is trained once with AdamW (a few minutes on two cores) and cached as a
Hugging Face folder, with a byte-level tokenizer, under ``$TIGHTFIT_CACHE_DIR/bench``
(default ``~/.cache/tightfit/bench``), keyed by a hash of the settings and the training
text; ``--retrain`` trains again.

Rows, each evaluated on the same ``--windows`` windows of the held-out text (one window a
forward, batch 1, ``WINDOW`` bytes predicted each):

- full precision (float32);
- each storage applied to every Linear it takes (``StorageFormat.apply``): the decoder
  layers' Linears with the LM head kept in float32, and the same with the LM head stored
  so too; the embedding is kept in both. Beside each: the storage's ``noise`` and the
  plan-style expected error of that choice (``sqrt(sum(numel x noise^2) / all Linear and
  Embedding weights)``, as ``plan.predicted_error`` counts it);
- ``tightfit.load(folder, budget, example_inputs=..., max_error=...)`` at shares of the
  unplanned peak (``plan.full_peak_bytes`` of a plan at a huge budget, for the evaluation
  forward's input and the loading), with the default bound (``max_error=None``, 3%) and
  unbounded (``max_error=1.0``);
- the context ``tightfit run --context auto`` chooses at the same budgets
  (``plan_only(RunOptions(..., context="auto"))``, the default prompt).

Perplexity is per byte: exp of the mean next-byte cross-entropy; bits per byte is that
cross-entropy over ln 2.

Run: python benchmarks/quality.py [--retrain] [--fractions 0.6,0.4,0.3,0.25] [--windows 128]
(writes benchmarks/results/quality.md and quality.json)
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch
from _common import (
    as_tightfit_run_threads,
    home_relative,
    load_average,
    machine,
    machine_lines,
    markdown_table,
    repository_state,
)
from torch import nn
from torch.nn import functional as F

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
#: The model: a small Llama, bytes as tokens, LM head not tied to the embedding.
CONFIG = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
#: Measured here first: one step of batch 8 x 256 bytes takes about 0.7 s on the 2-core
#: machine (load 1-2), so 500 steps are about 6 minutes.
TRAINING = dict(steps=500, batch=8, context=256, lr=2e-3, weight_decay=0.01, warmup=0.1, clip=1.0, seed=0)
#: Of every ten files (sorted by path): these indices train, this one is held out.
TRAIN_SLOTS, HELD_OUT_SLOT = (0, 1, 2, 3), 9
WINDOW = 256  # bytes predicted per evaluation window (the forward's input is batch 1 x WINDOW)
EXCLUDED_FOLDERS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
MARKER = "quality-training.json"  # written last: the folder is complete


# -- the corpus ----------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files, test folders and site-packages left out, sorted
    by their path under the library's folder."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [p for p in root.rglob("*.py") if not EXCLUDED_FOLDERS & set(p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def corpus() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(training bytes, held-out bytes, a description): files joined by a newline."""
    files = stdlib_files()
    train = [p for i, p in enumerate(files) if i % 10 in TRAIN_SLOTS]
    held = [p for i, p in enumerate(files) if i % 10 == HELD_OUT_SLOT]

    def joined(paths: list[Path]) -> torch.Tensor:
        blob = b"\n".join(p.read_bytes() for p in paths)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()

    described = {
        "stdlib": home_relative(Path(sysconfig.get_paths()["stdlib"])),
        "files": len(files),
        "training_files": len(train),
        "held_out_files": len(held),
    }
    training, held_out = joined(train), joined(held)
    described.update(training_bytes=len(training), held_out_bytes=len(held_out))
    return training, held_out, described


def windows(held_out: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` windows of WINDOW + 1 bytes, evenly spaced over the held-out text."""
    starts = torch.linspace(0, len(held_out) - WINDOW - 1, count).long()
    return torch.stack([held_out[s : s + WINDOW + 1] for s in starts.tolist()])


# -- the model -----------------------------------------------------------------------------


def cache_root() -> Path:
    base = os.environ.get("TIGHTFIT_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "tightfit") / "bench"


def settings_key(training: torch.Tensor) -> str:
    blob = repr((CONFIG, TRAINING, torch.__version__.split("+")[0])).encode() + training.numpy().tobytes()
    return hashlib.sha256(blob).hexdigest()[:12]


def write_byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer whose token ids are the bytes (0-255), no special tokens: what
    ``tightfit run`` needs in the folder to tokenize its prompt. Built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's reversible byte -> printable character map, which the ByteLevel steps use
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    vocab = {characters[byte]: byte for byte in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=CONFIG["max_position_embeddings"])
    wrapped.save_pretrained(folder)
    check = wrapped("def f(x):\n    return 'é'\n").input_ids
    if check != list("def f(x):\n    return 'é'\n".encode()):
        raise RuntimeError(f"the byte tokenizer does not give the bytes: {check}")


def train(folder: Path, training: torch.Tensor) -> dict:
    """Train the model on ``training``, save it and its tokenizer in ``folder``; returns
    what the training did (written last, as the folder's marker)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(TRAINING["seed"])
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    steps, batch, context = TRAINING["steps"], TRAINING["batch"], TRAINING["context"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAINING["lr"], weight_decay=TRAINING["weight_decay"])
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, TRAINING["lr"], total_steps=steps, pct_start=TRAINING["warmup"]
    )
    generator = torch.Generator().manual_seed(TRAINING["seed"])
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        offsets = torch.randint(0, len(training) - context - 1, (batch,), generator=generator)
        ids = torch.stack([training[o : o + context] for o in offsets.tolist()])
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING["clip"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            print(f"  step 0: loss {losses[0]:.3f} ({time.perf_counter() - start:.1f} s)", flush=True)
        elif step % 50 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    seconds = time.perf_counter() - start
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    done = {
        "training_seconds": seconds,
        "final_loss": losses[-1],
        "final_loss_mean_last_20": sum(losses[-20:]) / len(losses[-20:]),
        "first_loss": losses[0],
        "torch_threads": torch.get_num_threads(),
        "load_average_after": load_average(),
        "losses_every_50": losses[::50] + [losses[-1]],
    }
    (folder / MARKER).write_text(json.dumps(done, indent=1) + "\n")
    return done


def trained_model(training: torch.Tensor, retrain: bool) -> tuple[Path, nn.Module, dict, bool]:
    """(folder, model in eval mode, training record, whether trained now)."""
    from transformers import LlamaForCausalLM

    folder = cache_root() / f"quality-{settings_key(training)}"
    trained_now = retrain or not (folder / MARKER).is_file()
    if trained_now:
        print(f"training ({TRAINING['steps']} steps) into {home_relative(folder)}", flush=True)
        train(folder, training)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model, json.loads((folder / MARKER).read_text()), trained_now


# -- measuring -----------------------------------------------------------------------------


@torch.no_grad()
def perplexity(
    model: nn.Module, held: torch.Tensor, reference: list[torch.Tensor] | None = None
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Per-byte perplexity and bits per byte over the windows (one window a forward), with
    ``reference`` (full precision's next-byte log-probabilities) the mean KL divergence of
    this model's next-byte distribution from it; and this model's log-probabilities."""
    total, divergence, start, got = 0.0, 0.0, time.perf_counter(), []
    for index, window in enumerate(held):
        logits = model(input_ids=window[None, :-1], use_cache=False).logits[0].float()
        log_probs = torch.log_softmax(logits, dim=-1)
        total += F.nll_loss(log_probs, window[1:], reduction="sum").item()
        if reference is not None:
            base = reference[index]
            divergence += (base.exp() * (base - log_probs)).sum().item()
        got.append(log_probs)
    positions = held.shape[0] * (held.shape[1] - 1)
    nll = total / positions
    figures = {"perplexity": math.exp(nll), "bits_per_byte": nll / math.log(2)}
    if reference is not None:
        figures["kl_from_full"] = divergence / positions
    figures["eval_seconds"] = time.perf_counter() - start
    return figures, got


def leaf_weights(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Every Linear and Embedding leaf: name -> (kind, weights), a shared weight counted once."""
    seen, found = set(), {}
    for name, module in model.named_modules():
        if type(module) in (nn.Linear, nn.Embedding) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            found[name] = (type(module).__name__, module.weight.numel())
    return found


def expected_error(assigned: dict[str, str], leaves: dict[str, tuple[str, int]]) -> float:
    """The plan-style expected error of storing each named leaf as ``assigned`` says (a leaf
    whose kind the storage does not take stays as it is), over every leaf's weights."""
    from tightfit.quant import storage_format

    energy = 0.0
    for name, storage_name in assigned.items():
        storage = storage_format(storage_name)
        kind, numel = leaves[name]
        if kind in {t.__name__ for t in storage.leaf_types}:
            energy += numel * storage.noise**2
    return math.sqrt(energy / sum(numel for _, numel in leaves.values()))


def uniform_rows(model: nn.Module, held: torch.Tensor, full: dict, reference: list[torch.Tensor]) -> list[dict]:
    """Each storage on every decoder-layer Linear (LM head kept), then on the LM head too."""
    from tightfit.quant import storage_formats

    leaves = leaf_weights(model)
    linears = [name for name, (kind, _) in leaves.items() if kind == "Linear"]
    scopes = {
        "layer Linears (LM head kept)": [name for name in linears if name != "lm_head"],
        "every Linear (LM head too)": linears,
    }
    rows = []
    for storage in storage_formats():
        if storage.name == "keep":
            continue
        for scope, names in scopes.items():
            copied = copy.deepcopy(model)
            storage.apply(copied, frozenset(names))
            figures, _ = perplexity(copied, held, reference)
            row = {
                "storage": storage.name,
                "scope": scope,
                "layers": len(names),
                "noise": storage.noise,
                "predicted_error": expected_error(dict.fromkeys(names, storage.name), leaves),
                **figures,
                "perplexity_change": figures["perplexity"] / full["perplexity"] - 1,
            }
            rows.append(row)
            print(
                f"  {storage.name:<7} {scope:<29} noise {storage.noise:6.1%} expected {row['predicted_error']:6.2%}"
                f"  perplexity {row['perplexity']:.4f} ({row['perplexity_change']:+.2%})",
                flush=True,
            )
            del copied
    return rows


def plan_counts(plan) -> dict[str, int]:
    """Units per storage/placement, e.g. {"nf4/device": 4, "keep/device": 2}."""
    counts: dict[str, int] = {}
    for entry in plan.entries:
        key = f"{entry.storage}/{entry.placement}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def plan_rows(
    folder: Path,
    held: torch.Tensor,
    fractions: list[float],
    full_peak: int,
    full: dict,
    reference: list[torch.Tensor],
    leaves: dict,
) -> list[dict]:
    """``tightfit.load`` at each share of the unplanned peak, default bound and unbounded;
    ``leaves``: the full-precision model's :func:`leaf_weights`."""
    import tightfit
    from tightfit._format import human_bytes

    inputs = {"input_ids": held[:1, :-1]}
    rows = []
    for fraction in fractions:
        budget = int(full_peak * fraction)
        for label, bound in (("default (3%)", None), ("unbounded (1.0)", 1.0)):
            row: dict = {"fraction": fraction, "budget_bytes": budget, "bound": label, "max_error": bound}
            try:
                model, plan = tightfit.load(folder, budget, example_inputs=inputs, max_error=bound)
            except (tightfit.FitError, ValueError, RuntimeError) as error:
                row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"
                rows.append(row)
                print(f"  {fraction:.0%} {label}: {row['error'][:300]}", flush=True)
                continue
            assigned = {leaf: entry.storage for entry in plan.entries for leaf in entry.leaves}
            figures, _ = perplexity(model, held, reference)
            row.update(
                plan=plan_counts(plan),
                entries=[f"{e.module}: {e.storage}/{e.placement}" for e in plan.entries],
                predicted_error=plan.predicted_error,
                recomputed_error=expected_error(assigned, leaves),
                quality=plan.quality,
                predicted_peak_bytes=plan.predicted_peak_bytes,
                within_budget=plan.predicted_peak_bytes <= budget,
                predicted_seconds=plan.predicted_seconds,
                **figures,
                perplexity_change=figures["perplexity"] / full["perplexity"] - 1,
            )
            rows.append(row)
            print(
                f"  {fraction:.0%} ({human_bytes(budget)}) {label:<16} expected {plan.predicted_error:6.2%}"
                f" perplexity {row['perplexity']:.4f} ({row['perplexity_change']:+.2%}) peak "
                f"{human_bytes(plan.predicted_peak_bytes)} plan {row['plan']} quality: {plan.quality or '-'}",
                flush=True,
            )
            del model
    return rows


def monotone(rows: list[dict], bound: str) -> dict:
    """Whether perplexity never rises as the budget grows, for the rows with ``bound``
    (full precision not among them)."""
    measured = sorted(
        (row["budget_bytes"], row["perplexity"]) for row in rows if row["bound"] == bound and "perplexity" in row
    )
    broken = [
        {"smaller_budget": a[0], "larger_budget": b[0], "perplexity_smaller": a[1], "perplexity_larger": b[1]}
        for a, b in zip(measured, measured[1:])
        if b[1] > a[1]
    ]
    return {"bound": bound, "budgets": len(measured), "monotone": not broken, "violations": broken}


def context_rows(folder: Path, budgets: list[tuple[float, int]]) -> list[dict]:
    """The context ``--context auto`` plans for at each budget (``plan_only``)."""
    from tightfit.app.run import RunOptions, plan_only

    rows = []
    for fraction, budget in budgets:
        row: dict = {"fraction": fraction, "budget_bytes": budget}
        try:
            budgeted = plan_only(RunOptions(model=str(folder), budget=budget, context="auto"))
        except Exception as error:  # noqa: BLE001 - the failure is the figure: reported, not hidden
            row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())}"
        else:
            plan = budgeted.plan
            row.update(
                context=budgeted.context,
                covers=budgeted.covers,
                kv_cache_bytes=budgeted.kv_cache_bytes,
                plan=plan_counts(plan),
                predicted_error=plan.predicted_error,
                quality=plan.quality,
                predicted_peak_bytes=plan.predicted_peak_bytes,
                within_budget=plan.predicted_peak_bytes <= budget,
            )
        rows.append(row)
        print(f"  context auto at {fraction:.0%}: {row.get('context', row.get('error'))}", flush=True)
    return rows


def tightfit_source() -> str:
    """This checkout's commit and state when tightfit is imported from its ``src/``; else
    where it is imported from (``PYTHONPATH``, e.g. an export of a commit)."""
    import tightfit

    source = Path(tightfit.__file__).resolve().parent.parent
    if source == REPO / "src":
        return repository_state()
    return f"imported from {home_relative(source)} (PYTHONPATH), not this checkout's src/"


def command_arguments() -> list[str]:
    """The command line's arguments, ``--note`` and its text left out (the report shows it)."""
    arguments, skip = [], False
    for argument in sys.argv[1:]:
        if skip or argument.startswith("--note="):
            skip = False
            continue
        if argument == "--note":
            skip = True
            continue
        arguments.append(argument)
    return arguments


def python_path() -> list[str]:
    """``PYTHONPATH=...`` for the command line, where it is set."""
    value = os.environ.get("PYTHONPATH")
    return [f"PYTHONPATH={home_relative(Path(value))}"] if value else []


# -- the report ----------------------------------------------------------------------------


def _plan_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{count} {what}" for what, count in counts.items())


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties given their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        ranked = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                ranked[order[k]] = (i + j) / 2
            i = j + 1
        return ranked

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / spread if spread else float("nan")


def uniform_summary(rows: list[dict]) -> list[str]:
    """What the uniform rows show, in plain words, from the figures."""
    errors = [r["predicted_error"] for r in rows]
    rho = spearman(errors, [r["perplexity"] for r in rows])
    rho_kl = spearman(errors, [r["kl_from_full"] for r in rows])
    eight = [r for r in rows if r["noise"] < 0.03]
    four = [r for r in rows if r["noise"] >= 0.03]
    lines = [
        f"- Rank correlation (Spearman) of expected error with perplexity over these {len(rows)} rows: {rho:.2f}; "
        f"with the KL divergence from full precision: {rho_kl:.2f}."
    ]
    if eight:
        low, high = min(r["perplexity_change"] for r in eight), max(r["perplexity_change"] for r in eight)
        lines.append(
            f"- Storages with noise under 3% ({', '.join(sorted({r['storage'] for r in eight}))}): perplexity "
            f"changes from {low:+.3%} to {high:+.3%} of full precision."
        )
    if four:
        low, high = min(r["perplexity_change"] for r in four), max(r["perplexity_change"] for r in four)
        lines.append(
            f"- Storages with noise of 3% or more ({', '.join(sorted({r['storage'] for r in four}))}): "
            f"{low:+.3%} to {high:+.3%}."
        )
    return lines


def _budget(row: dict) -> int:
    return row["budget_bytes"]


def _short_error(text: str) -> str:
    """A FitError's point: the smallest peak reachable and what dominates it."""
    found = re.search(r"reaches is ([^,]*), dominated by ([^(.;]*)", text)
    if found:
        return f"FitError: the smallest predicted peak is {found[1]}, dominated by {found[2].strip()}"
    return text[:300]


def _short_quality(text: str) -> str:
    """``plan.quality`` without its definition of the expected error (in the column's head)."""
    return re.sub(r" \(RMS over the weights of each layer output's relative error\)", "", text) or "-"


def report(results: dict) -> str:
    from tightfit._format import human_bytes

    full = results["full_precision"]
    training = results["training"]
    lines = [
        "# Perplexity against the planner's expected error, on a trained small LM",
        "",
        *machine_lines(
            {
                "tightfit at": results["tightfit_at"],
                "date": results["date"],
                "load average (1, 5, 15 min) at the start": results["load_at_start"],
                "load average at the end": results["load_at_end"],
                "threading": results["threading"],
            }
        ),
        f"- command: `{results['command']}`",
        *([f"- note: {results['note']}"] if results["note"] else []),
        f"- model: Llama-style, {results['parameters'] / 1e6:.2f}M parameters (float32), bytes as tokens: "
        f"{json.dumps({k: v for k, v in CONFIG.items() if not k.endswith('token_id')})}; "
        f"cached at {results['folder']}",
        f"- training: {json.dumps(TRAINING)}; {training['training_seconds']:.0f} s "
        f"({'this run' if results['trained_now'] else 'an earlier run, read from the cache'}); "
        f"loss (nats per byte) {training['first_loss']:.3f} at the first step, {training['final_loss']:.3f} at the "
        f"last, {training['final_loss_mean_last_20']:.3f} the mean of the last 20",
        f"- corpus: {results['corpus']['files']} `*.py` files of the standard library ({results['corpus']['stdlib']}, "
        f"test folders left out), sorted by path; training: files 0-3 of every 10 "
        f"({results['corpus']['training_files']} files, {results['corpus']['training_bytes']:,} bytes); held out: "
        f"file 9 of every 10 ({results['corpus']['held_out_files']} files, "
        f"{results['corpus']['held_out_bytes']:,} bytes)",
        f"- evaluation: {results['windows']} windows of {WINDOW} predicted bytes, evenly spaced over the held-out "
        f"text, one window a forward (batch 1 x {WINDOW}); perplexity per byte",
        "",
        f"Full precision (float32): perplexity **{full['perplexity']:.4f}**, {full['bits_per_byte']:.4f} bits per "
        "byte.",
        "",
        "## Each storage on every Linear it takes",
        "",
        "The embedding stays float32 in every row. *noise* is the storage's declared relative output "
        "error; *expected error* is what `plan.predicted_error` would say for this choice (RMS of the noise "
        "over all Linear and Embedding weights, so it is smaller than the noise where some weights stay); "
        "*change*: perplexity relative to full precision; *KL*: the mean KL divergence of the next-byte "
        "distribution from full precision's, per byte.",
        "",
        markdown_table(
            ["storage", "applied to", "noise", "expected error", "perplexity", "change", "bits/byte", "KL (nats)"],
            [
                [
                    r["storage"],
                    r["scope"],
                    f"{r['noise']:.1%}",
                    f"{r['predicted_error']:.2%}",
                    f"{r['perplexity']:.4f}",
                    f"{r['perplexity_change']:+.3%}",
                    f"{r['bits_per_byte']:.4f}",
                    f"{r['kl_from_full']:.5f}",
                ]
                for r in results["uniform"]
            ],
            align="llrrrrrr",
        ),
        "",
        *uniform_summary(results["uniform"]),
        "",
        "## The planner's plans",
        "",
        f"Unplanned peak (`plan.full_peak_bytes` at a huge budget, the evaluation forward and loading): "
        f"{human_bytes(results['full_peak_bytes'])} ({results['full_peak_bytes']:,} B). Each plan made and loaded "
        "by `tightfit.load(folder, budget, example_inputs={'input_ids': <1 x 256>}, max_error=...)`. "
        "*plan*: units per storage/placement.",
        "",
    ]
    plan_table = []
    for r in results["plans"]:
        head = [f"{r['fraction']:.0%} ({human_bytes(r['budget_bytes'])})", r["bound"]]
        if "error" in r:
            plan_table.append([*head, "failed: " + _short_error(r["error"]), "", "", "", "", "", ""])
            continue
        plan_table.append(
            [
                *head,
                _plan_text(r["plan"]),
                f"{human_bytes(r['predicted_peak_bytes'])} ({'within' if r['within_budget'] else 'OVER'})",
                f"{r['predicted_error']:.2%}",
                _short_quality(r["quality"]),
                f"{r['perplexity']:.4f}",
                f"{r['perplexity_change']:+.3%}",
                f"{r['kl_from_full']:.5f}",
            ]
        )
    lines += [
        markdown_table(
            [
                "budget",
                "max_error",
                "plan",
                "predicted peak",
                "expected error",
                "plan.quality (shortened)",
                "perplexity",
                "change",
                "KL (nats)",
            ],
            plan_table,
            align="lllrrlrrr",
        ),
        "",
    ]
    for check in results["monotone"]:
        if check["monotone"]:
            lines.append(
                f"- {check['bound']}: perplexity never rises as the budget grows over these {check['budgets']} "
                "budgets (full precision not counted)."
            )
        else:
            told = "; ".join(
                f"{human_bytes(v['smaller_budget'])} {v['perplexity_smaller']:.4f} -> "
                f"{human_bytes(v['larger_budget'])} {v['perplexity_larger']:.4f} "
                f"({v['perplexity_larger'] / v['perplexity_smaller'] - 1:+.4%})"
                for v in check["violations"]
            )
            lines.append(f"- {check['bound']}: perplexity rises with a bigger budget: {told}.")
    for bound in ("default (3%)", "unbounded (1.0)"):
        planned = sorted((r for r in results["plans"] if r["bound"] == bound and "predicted_error" in r), key=_budget)
        listed = ", ".join(f"{r['fraction']:.0%}: {r['predicted_error']:.2%} -> {r['perplexity']:.5f}" for r in planned)
        lines.append(f"- {bound}, expected error -> perplexity by budget, smallest first: {listed}.")
        if planned:
            values = [r["perplexity"] for r in planned]
            lines.append(
                f"- {bound}: these plans' perplexities lie within {max(values) / min(values) - 1:.4%} of each other "
                f"and within {max(abs(r['perplexity_change']) for r in planned):.4%} of full precision."
            )
    lines += [
        f"- Every plan's expected error recomputed from its entries matches `plan.predicted_error`: "
        f"{results['recomputed_matches']}.",
        "",
        "## `--context auto` at the same budgets",
        "",
        "`plan_only(RunOptions(model=folder, budget=B, context='auto'))` with the default prompt and bound.",
        "",
    ]
    context_table = []
    for r in results["contexts"]:
        head = [f"{r['fraction']:.0%} ({human_bytes(r['budget_bytes'])})"]
        if "error" in r:
            context_table.append([*head, "failed: " + r["error"][:300], "", "", "", ""])
            continue
        context_table.append(
            [
                *head,
                str(r["context"]),
                human_bytes(r["kv_cache_bytes"]),
                _plan_text(r["plan"]),
                f"{r['predicted_error']:.2%}",
                r["covers"],
            ]
        )
    lines += [
        markdown_table(["budget", "context", "KV cache", "plan", "expected error", "covers"], context_table, "lrrlrl"),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="train again even where the cache holds the model")
    parser.add_argument("--fractions", default="0.6,0.4,0.3,0.25", help="budgets as shares of the unplanned peak")
    parser.add_argument("--windows", type=int, default=128, help="held-out windows evaluated")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--note", default="", help="a line for the report's header (how this run was made)")
    parser.add_argument("--json", type=Path, default=RESULTS / "quality.json", help="the figures as JSON")
    parser.add_argument("--out", type=Path, default=RESULTS / "quality.md", help="the markdown report")
    args = parser.parse_args()
    threading = as_tightfit_run_threads()  # may start the script again, before any work
    torch.set_num_threads(args.threads)
    fractions = [float(text) for text in args.fractions.split(",") if text]
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([*python_path(), "python benchmarks/quality.py", *command_arguments()]),
        "note": args.note,
        "machine": machine(),
        "tightfit_at": tightfit_source(),
        "load_at_start": load_average(),
        "threading": threading,
        "config": CONFIG,
        "training_settings": TRAINING,
        "windows": args.windows,
        "window": WINDOW,
    }
    training, held_out, results["corpus"] = corpus()
    folder, model, results["training"], results["trained_now"] = trained_model(training, args.retrain)
    results["folder"] = home_relative(folder)
    results["parameters"] = sum(p.numel() for p in model.parameters())
    held = windows(held_out, args.windows)

    print("full precision", flush=True)
    full, reference = perplexity(model, held)
    results["full_precision"] = full
    print(f"  perplexity {full['perplexity']:.4f}, {full['bits_per_byte']:.4f} bits per byte", flush=True)
    print("each storage on every Linear it takes", flush=True)
    results["uniform"] = uniform_rows(model, held, full, reference)
    leaves = leaf_weights(model)
    del model

    from tightfit.loading import plan_folder

    _, huge = plan_folder(folder, 1 << 40, example_inputs={"input_ids": held[:1, :-1]})
    results["full_peak_bytes"] = huge.full_peak_bytes
    print(f"plans (unplanned peak {huge.full_peak_bytes:,} B)", flush=True)
    results["plans"] = plan_rows(folder, held, fractions, huge.full_peak_bytes, full, reference, leaves)
    results["monotone"] = [monotone(results["plans"], bound) for bound in ("default (3%)", "unbounded (1.0)")]
    results["recomputed_matches"] = all(
        abs(r["recomputed_error"] - r["predicted_error"]) <= 1e-9 for r in results["plans"] if "predicted_error" in r
    )
    print("--context auto", flush=True)
    budgets = [(fraction, int(huge.full_peak_bytes * fraction)) for fraction in fractions]
    results["contexts"] = context_rows(folder, budgets)
    results["load_at_end"] = load_average()

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    args.out.write_text(report(results))
    print(f"written to {args.out} and {args.json}")


if __name__ == "__main__":
    main()
