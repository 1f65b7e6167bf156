"""What each compact storage and compute choice costs in quality, on a language model that
has learned something: a small Llama-style model trained here, on real English text that
ships with Python (the CPython documentation's topics, ``pydoc_data.topics``), then
evaluated on text it never saw, in every storage tightfit offers.

Random weights say nothing about quality: their next-token choices are near ties, so any
rounding flips them. This model is trained for a few minutes on the CPU (bytes as tokens,
so no tokenizer needs downloading) and cached under ``~/.cache/tightfit-bench/`` (a
Hugging Face folder, reused by later runs). Each row quantizes every Linear layer, the LM
head included, as ``tightfit run --quant Q --all-4bit [--compute int8]`` does, and reports
on the held-out tenth of the text:

- perplexity (bytes): exp of the mean next-byte cross-entropy;
- top-1 agreement: how often its most likely next byte is full precision's;
- KL: the mean KL divergence of its next-byte distribution from full precision's.

Run: python benchmarks/lm_quality.py  (training about 3 minutes on two cores, once;
evaluation about a minute)
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import pydoc_data.topics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from _common import home_relative, machine_lines, markdown_table
from torch import nn

from tightfit.app.run import STORAGE_DTYPE_CHOICES, quant_configs
from tightfit.hooks import apply_layerwise_casting
from tightfit.quant import quantize_

#: The model: small enough to train in minutes on two cores, every Linear's input a
#: multiple of 128 (the 4-bit kernels' vector loops).
CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TRAINING = dict(steps=900, batch=16, context=128, lr=3e-3, seed=0)
EVAL_WINDOWS, EVAL_CONTEXT = 96, 128


def text_bytes() -> torch.Tensor:
    """The CPython documentation's topics as bytes, in a fixed order."""
    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def split(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training text and held-out text: the last tenth, which training never reads."""
    cut = len(data) * 9 // 10
    return data[:cut], data[cut:]


def _key(data: torch.Tensor) -> str:
    blob = repr((CONFIG, TRAINING, torch.__version__.split("+")[0])).encode() + data.numpy().tobytes()
    return hashlib.sha256(blob).hexdigest()[:12]


def trained_model(cache: Path) -> tuple[nn.Module, str]:
    """The trained model (float32), from the cache or trained now; and how it was had."""
    from transformers import LlamaConfig, LlamaForCausalLM

    data = text_bytes()
    folder = cache / f"lm-quality-{_key(data)}"
    if (folder / "config.json").exists():
        return LlamaForCausalLM.from_pretrained(
            folder, dtype=torch.float32
        ).eval(), f"cached at {home_relative(folder)}"
    train, _ = split(data)
    torch.manual_seed(TRAINING["seed"])
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAINING["lr"], weight_decay=0.01)
    steps, batch, context = TRAINING["steps"], TRAINING["batch"], TRAINING["context"]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, TRAINING["lr"], total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(TRAINING["seed"])
    start = time.perf_counter()
    for step in range(steps):
        offsets = torch.randint(0, len(train) - context - 1, (batch,), generator=generator)
        ids = torch.stack([train[o : o + context + 1] for o in offsets.tolist()])
        loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1].clone(), use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step}: training loss {loss.item():.3f}", flush=True)
    model.eval()
    model.save_pretrained(folder)
    return model, f"trained now in {time.perf_counter() - start:.0f} s, cached at {home_relative(folder)}"


def held_out_windows() -> torch.Tensor:
    """EVAL_WINDOWS windows of EVAL_CONTEXT + 1 bytes, evenly spaced over the held-out text."""
    _, held = split(text_bytes())
    starts = torch.linspace(0, len(held) - EVAL_CONTEXT - 2, EVAL_WINDOWS).long()
    return torch.stack([held[s : s + EVAL_CONTEXT + 1] for s in starts.tolist()])


@torch.no_grad()
def log_probs(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Next-byte log-probabilities at every position (windows x context x 256), float32."""
    chunks = [model(input_ids=w[:, :-1], use_cache=False).logits.float() for w in windows.split(16)]
    return torch.log_softmax(torch.cat(chunks), dim=-1)


def quality(reference: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    nll = -got.gather(-1, targets.unsqueeze(-1)).mean()
    kl = (reference.exp() * (reference - got)).sum(-1).mean()
    agree = (got.argmax(-1) == reference.argmax(-1)).float().mean()
    return {"perplexity": math.exp(nll.item()), "top-1 agreement": agree.item(), "KL": kl.item()}


def variants() -> list[tuple[str, Callable[[nn.Module], nn.Module]]]:
    def quantized(name: str, compute: str = "float") -> Callable[[nn.Module], nn.Module]:
        def make(model: nn.Module) -> nn.Module:
            config = quant_configs()[name]
            if compute != "float":
                config = replace(config, compute=compute)
            return quantize_(model, config)

        return make

    def cast(name: str) -> Callable[[nn.Module], nn.Module]:
        def make(model: nn.Module) -> nn.Module:
            apply_layerwise_casting(model.to(torch.bfloat16), STORAGE_DTYPE_CHOICES[name], torch.bfloat16)
            return model

        return make

    return [
        ("float32 (full precision)", lambda model: model),
        ("bf16", lambda model: model.to(torch.bfloat16)),
        ("int8 (LLM.int8, threshold 6)", quantized("int8")),
        ("8-bit blockwise", quantized("8bit")),
        ("8-bit blockwise, int8 compute", quantized("8bit", "int8")),
        ("float8 e4m3 (layerwise casting, bf16 compute)", cast("float8_e4m3fn")),
        ("nf4", quantized("nf4")),
        ("nf4, int8 compute", quantized("nf4", "int8")),
        ("fp4", quantized("fp4")),
        ("fp4, int8 compute", quantized("fp4", "int8")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "tightfit-bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lm_quality.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, how = trained_model(args.cache_dir)
    windows = held_out_windows()
    targets = windows[:, 1:]
    reference = log_probs(model, windows)
    rows = []
    for name, build in variants():
        got = reference if name.startswith("float32") else log_probs(build(copy.deepcopy(model)), windows)
        figures = quality(reference, got, targets)
        rows.append([name, f"{figures['perplexity']:.4f}", f"{figures['top-1 agreement']:.4f}", f"{figures['KL']:.5f}"])
        print(" | ".join(rows[-1]), flush=True)
    parameters = sum(p.numel() for p in model.parameters())
    lines = [
        "# Quality of each storage on a trained small LM",
        "",
        *machine_lines({}),
        f"- model: Llama-style, {parameters / 1e6:.2f}M parameters, bytes as tokens; {how}",
        f"- trained on: the first 90% of pydoc_data.topics ({len(text_bytes()):,} bytes); {TRAINING}",
        f"- evaluated on: {EVAL_WINDOWS} windows of {EVAL_CONTEXT} bytes from the held-out last 10%",
        "- command: python benchmarks/lm_quality.py",
        "",
        markdown_table(["storage", "perplexity", "top-1 agreement", "KL from float32"], rows, align="lrrr"),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
