"""QLoRA-style fine-tune, tightfit against bitsandbytes: a small Llama (random weights from
a config, nothing downloaded) with every decoder Linear frozen in NF4 (double-quantized scales, as QLoRA) and a trainable
rank-8 adapter beside it, trained with AdamW on the same batches from the same seed. The
packed codes are bit-equal, so the two loss curves should agree to float rounding; the
step times are what the backward through each library's 4-bit layer costs.

Run: python benchmarks/qlora.py [--steps 40]   (bitsandbytes and transformers are test extras)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn


class LoRA(nn.Module):
    """``base(x) + x @ A.T @ B.T * scale`` with B starting at zero, as PEFT's LoRA."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int = 8) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(rank, in_features) / in_features**0.5)
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t() * self.scale


def _tightfit_nf4(linear: nn.Linear) -> nn.Module:
    from tightfit.quant.modules import Linear4bit

    return Linear4bit.from_linear(linear, quant_type="nf4", compress_statistics=True)


def _bnb_nf4(linear: nn.Linear) -> nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=torch.float32,
        quant_type="nf4",
    )
    layer.weight = bnb.nn.Params4bit(
        linear.weight.data.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True
    )
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    return layer.to("cpu")  # quantizes


def adapted(model: nn.Module, quantize) -> nn.Module:
    """``model`` frozen, its decoder Linears quantized by ``quantize``, each with an adapter (same seed)."""
    model = copy.deepcopy(model).requires_grad_(False)
    torch.manual_seed(1)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRA(quantize(child), child.in_features, child.out_features))
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

    results = train({"tightfit": adapted(base, _tightfit_nf4), "bitsandbytes": adapted(base, _bnb_nf4)}, batches)
    print(
        f"{args.steps} steps, batch {args.batch} x {args.seq} tokens, {torch.get_num_threads()} threads, float32, CPU"
    )
    print(f"{'step':>4}  {'tightfit loss':>13}  {'bnb loss':>9}  {'difference':>10}")
    tf_losses, bnb_losses = results["tightfit"][0], results["bitsandbytes"][0]
    for step in range(0, args.steps, max(1, args.steps // 10)):
        print(
            f"{step:>4}  {tf_losses[step]:>13.5f}  {bnb_losses[step]:>9.5f}  {tf_losses[step] - bnb_losses[step]:>10.2e}"
        )
    print(f"largest loss difference: {max(abs(a - b) for a, b in zip(tf_losses, bnb_losses, strict=True)):.2e}")
    for name, (_, times) in results.items():
        steady = times[2:]  # the first steps compile kernels
        print(
            f"{name:>12} step time: median {statistics.median(steady) * 1e3:.1f} ms, mean {statistics.mean(steady) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
