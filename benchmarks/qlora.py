"""QLoRA-style fine-tune, tightfit against bitsandbytes: a small Llama (random weights from
a config, nothing downloaded) with every decoder Linear frozen in NF4 (double-quantized scales, as QLoRA) and a trainable
rank-8 adapter beside it, trained with AdamW on the same batches from the same seed. The
step times are what the backward through each library's 4-bit layer costs.

With float32 scales (``--no-double-quant``) the weights are bit-equal and so are the loss
curves. With double quantization a few 8-bit codes of the scales differ by one step:
bitsandbytes' native CPU kernel rounds values within a few parts per million of a
midpoint of the map the other way (tightfit takes the nearest entry, as bitsandbytes'
Python reference does), so the curves differ by what those scales change.

What "agree" means is measured beside them, as noise: two more bitsandbytes runs, one
whose adapters start from another seed (the spread a rerun with a new seed shows) and one
whose adapters start one float32 rounding step away from the first (how far training
carries a rounding difference, the only kind tightfit and bitsandbytes should have). Each
curve is compared with the first bitsandbytes run: largest and mean |loss difference|.

Run: python benchmarks/qlora.py [--steps 40] [--no-double-quant]   (bitsandbytes and transformers are test extras)
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch
from torch import nn


class LoRA(nn.Module):
    """``base(x) + x @ A.T @ B.T * scale`` with B starting at zero, as PEFT's LoRA."""

    def __init__(
        self, base: nn.Module, in_features: int, out_features: int, generator: torch.Generator, rank: int = 8
    ) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(rank, in_features, generator=generator) / in_features**0.5)
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t() * self.scale


def _tightfit_nf4(linear: nn.Linear, double_quant: bool) -> nn.Module:
    from tightfit.quant.modules import Linear4bit

    return Linear4bit.from_linear(linear, quant_type="nf4", compress_statistics=double_quant)


def _bnb_nf4(linear: nn.Linear, double_quant: bool) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.float32,
        quant_type="nf4",
    )
    layer.weight = bnb.nn.Params4bit(
        linear.weight.data.clone(), requires_grad=False, quant_type="nf4", compress_statistics=double_quant
    )
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to("cpu")  # quantizes


def adapted(model: nn.Module, quantize, seed: int = 1, nudge: bool = False) -> nn.Module:
    """``model`` frozen, its decoder Linears quantized by ``quantize``, each with an adapter
    drawn from ``seed``; ``nudge`` moves every adapter value one float32 step up. The
    adapters have their own generator: bitsandbytes' Linear4bit draws from the global one
    (it initializes a weight it then replaces), which would shift the adapters' draws."""
    model = copy.deepcopy(model).requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    lora = LoRA(quantize(child), child.in_features, child.out_features, generator)
                    if nudge:
                        lora.A.data = torch.nextafter(lora.A.data, torch.tensor(float("inf")))
                    setattr(parent, name, lora)
    return model


def train(models: dict[str, nn.Module], batches: list[torch.Tensor]) -> dict[str, tuple[list[float], list[float]]]:
    """Train each model's adapters on ``batches``, the models' steps interleaved (in
    alternating order) so that a busy machine slows all alike; (losses, step times) by name."""
    optimizers = {}
    for name, model in models.items():
        adapters = [p for n, p in model.named_parameters() if n.endswith((".A", ".B"))]
        for p in adapters:
            p.requires_grad_(True)
        optimizers[name] = torch.optim.AdamW(adapters, lr=3e-3)
    results = {name: ([], []) for name in models}
    for step, batch in enumerate(batches):
        for name in list(models)[:: 1 if step % 2 == 0 else -1]:
            start = time.perf_counter()
            optimizers[name].zero_grad()
            loss = models[name](input_ids=batch, labels=batch).loss
            loss.backward()
            optimizers[name].step()
            results[name][1].append(time.perf_counter() - start)
            results[name][0].append(loss.item())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--double-quant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="quantize the absmax scales too, as QLoRA (default); --no-double-quant keeps them float32",
    )
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    base = LlamaForCausalLM(config).eval()  # eval: no dropout, so both runs see the same graph
    # A learnable task: four fixed batches, cycled, of sequences that repeat a random 8-token motif.
    generator = torch.Generator().manual_seed(2)
    motifs = torch.randint(0, config.vocab_size, (4, args.batch, 8), generator=generator)
    data = motifs.repeat(1, 1, args.seq // 8)
    batches = [data[step % 4] for step in range(args.steps)]

    bnb_nf4 = functools.partial(_bnb_nf4, double_quant=args.double_quant)
    models = {
        "tightfit": adapted(base, functools.partial(_tightfit_nf4, double_quant=args.double_quant)),
        "bitsandbytes": adapted(base, bnb_nf4),
        "bnb, seed 3": adapted(base, bnb_nf4, seed=3),
        "bnb, nudged": adapted(base, bnb_nf4, nudge=True),
    }
    results = train(models, batches)
    print(
        f"{args.steps} steps, batch {args.batch} x {args.seq} tokens, {torch.get_num_threads()} threads, float32, CPU, "
        f"{'double-quantized' if args.double_quant else 'float32'} scales"
    )
    losses = {name: result[0] for name, result in results.items()}
    reference = losses["bitsandbytes"]
    print(f"{'step':>4}" + "".join(f"{name:>14}" for name in losses) + f"{'tf - bnb':>11}")
    for step in range(0, args.steps, max(1, args.steps // 10)):
        row = "".join(f"{curve[step]:>14.5f}" for curve in losses.values())
        print(f"{step:>4}{row}{losses['tightfit'][step] - reference[step]:>11.2e}")
    print("|loss - bitsandbytes' loss| over the steps:")
    for name in ("tightfit", "bnb, seed 3", "bnb, nudged"):
        gaps = [abs(a - b) for a, b in zip(losses[name], reference, strict=True)]
        print(f"{name:>14}: largest {max(gaps):.2e}, mean {statistics.mean(gaps):.2e}, last {gaps[-1]:.2e}")
    for name, (_, times) in results.items():
        steady = times[2:]  # the first steps compile kernels
        print(
            f"{name:>14} step time: median {statistics.median(steady) * 1e3:.1f} ms, mean {statistics.mean(steady) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
