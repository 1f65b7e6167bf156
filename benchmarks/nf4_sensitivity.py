"""Where NF4 loses quality on all-MiniLM-L6-v2, measured: the lowest and mean embedding
cosine to full precision when one Linear layer, one kind of layer or one block of layers
is in NF4 and the rest stays in float32; then blocksize, double quantization, compute
dtype and the int8 compute choice for the whole model; then rules that keep some layers in 8 bits or in float32, with
the weights' bytes that ``tightfit run`` reports.

Each cosine is measured on two sentence sets: the built-in sentences of ``tightfit run``
and other sentences that no choice here was made on, to tell a rule that generalizes
from one fitted to eight sentences.

Run: python benchmarks/nf4_sensitivity.py   (about two minutes on two CPU cores)
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tightfit.app.models import default_model_dir, embed, load_encoder
from tightfit.app.run import DEFAULT_SENTENCES, weights_bytes
from tightfit.quant import Blockwise8Config, FP4Config, Linear4bit, NF4Config, layer_stack, quantize_

OTHER_SENTENCES = [
    "The cat sat quietly on the windowsill, watching the rain.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "How do I reset my password if I no longer have access to my email?",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Quantum computers exploit superposition to explore many states at once.",
    "He missed the last train and had to walk home in the cold.",
    "The committee postponed its decision until next Tuesday.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "She plays the violin in a small orchestra every weekend.",
    "Please turn off the lights when you leave the room.",
    "The museum's new exhibition features paintings from the 17th century.",
    "A child is playing with a red ball in the park.",
    "Two dogs are running through a snowy field.",
    "The software update fixed a critical security vulnerability.",
    "It was the best of times, it was the worst of times.",
    "Our flight was delayed by three hours because of fog.",
]
KINDS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
DEVICE = torch.device("cpu")


def kind_of(name: str) -> str:
    return name.split(".", 3)[3]  # encoder.layer.<i>.<kind>


class Bench:
    def __init__(self) -> None:
        self.model, self.tokenizer = load_encoder(default_model_dir(), DEVICE)
        self.sets = {"built-in": list(DEFAULT_SENTENCES), "other": OTHER_SENTENCES}
        self.reference = {key: embed(self.model, self.tokenizer, s, DEVICE) for key, s in self.sets.items()}
        self.linears = [
            name for name, m in self.model.named_modules() if type(m) is nn.Linear and name.startswith("encoder.")
        ]

    def cosines(self, model: nn.Module) -> str:
        cells = []
        for key, sentences in self.sets.items():
            cosine = (embed(model, self.tokenizer, sentences, DEVICE) * self.reference[key]).sum(-1)
            cells += [f"{float(cosine.min()):.4f}", f"{float(cosine.mean()):.4f}"]
        return " | ".join(cells)

    def only(self, names: list[str], **options) -> str:
        """Cosines with just ``names`` in NF4 (swapped in place, then restored)."""
        originals = {}
        for name in names:
            parent, _, leaf = name.rpartition(".")
            originals[name] = getattr(self.model.get_submodule(parent), leaf)
            setattr(self.model.get_submodule(parent), leaf, Linear4bit.from_linear(originals[name], **options))
        row = self.cosines(self.model)
        for name, linear in originals.items():
            parent, _, leaf = name.rpartition(".")
            setattr(self.model.get_submodule(parent), leaf, linear)
        return row

    def whole(self, config) -> tuple[str, int]:
        model = quantize_(copy.deepcopy(self.model), config)
        return self.cosines(model), weights_bytes([model])


def main() -> None:
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    bench = Bench()
    header = "| built-in min | built-in mean | other min | other mean |"
    print(
        f"One Linear layer in NF4 (blocksize 64), the rest float32; weight error is |W - NF4(W)| / |W|\n\n"
        f"| layer | kind | weight error {header}\n|---|---|---|---|---|---|---|"
    )
    for name in bench.linears:
        linear = bench.model.get_submodule(name)
        error = float((Linear4bit.from_linear(linear).dequantize() - linear.weight).norm() / linear.weight.norm())
        print(f"| {name.split('.')[2]} | {kind_of(name)} | {error:.3f} | {bench.only([name])} |", flush=True)
    print(f"\nOne kind in every layer, or every kind in one layer, in NF4\n\n| in NF4 {header}\n|---|---|---|---|---|")
    for kind in KINDS:
        print(f"| {kind} (6 layers) | {bench.only([n for n in bench.linears if kind_of(n) == kind])} |", flush=True)
    for index in range(6):
        print(
            f"| encoder.layer.{index} | {bench.only([n for n in bench.linears if n.split('.')[2] == str(index)])} |",
            flush=True,
        )
    print(f"\nEvery Linear layer in NF4\n\n| blocksize, double quant {header}\n|---|---|---|---|---|")
    for blocksize in (32, 64, 128, 256):
        for nested in (False, True):
            print(
                f"| {blocksize}, {nested} | {bench.only(bench.linears, blocksize=blocksize, compress_statistics=nested)} |",
                flush=True,
            )
    print(f"| 64, False, int8 compute (activations int8 per 32) | {bench.only(bench.linears, compute='int8')} |")
    bf16 = copy.deepcopy(bench.model).to(torch.bfloat16)
    print(f"| bfloat16 model, no quantization | {bench.cosines(bf16)} |")
    print(f"| bfloat16 compute, 64, False | {bench.cosines(quantize_(copy.deepcopy(bf16), NF4Config()))} |")
    print(f"| bfloat16, int8 compute, 64, False | {bench.cosines(quantize_(bf16, NF4Config(compute='int8')))} |")

    stack = layer_stack(bench.model)
    rules = {
        "none": (),
        "first and last layer": (stack[0], stack[-1]),
        "later third of the layers": stack[len(stack) * 2 // 3 :],
        "later half of the layers": stack[len(stack) // 2 :],
        "value and intermediate, every layer": ("*.attention.self.value", "*.intermediate.dense"),
    }
    print(
        f"\nNF4 (FP4 where it says so), blocksize 64, except the kept layers; bytes as tightfit run reports them (full precision: "
        f"{weights_bytes([bench.model]) / 2**20:.1f} MiB)\n\n| kept | kept in {header} weights |\n|---|---|---|---|---|---|---|"
    )
    for label, patterns in rules.items():
        row, size = bench.whole(NF4Config(keep_8bit=patterns))
        print(f"| {label} | {'8 bits' if patterns else '-'} | {row} | {size / 2**20:.2f} MiB |", flush=True)
        if patterns:
            row, size = bench.whole(NF4Config(skip=patterns))
            print(f"| {label} | float32 | {row} | {size / 2**20:.2f} MiB |", flush=True)
    row, size = bench.whole(Blockwise8Config())
    print(f"| everything | 8 bits | {row} | {size / 2**20:.2f} MiB |")
    for label, patterns in (("none, FP4", ()), ("later half of the layers, FP4", stack[len(stack) // 2 :])):
        row, size = bench.whole(FP4Config(keep_8bit=patterns))
        print(f"| {label} | {'8 bits' if patterns else '-'} | {row} | {size / 2**20:.2f} MiB |", flush=True)


if __name__ == "__main__":
    main()
