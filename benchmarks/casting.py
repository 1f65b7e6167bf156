"""Layerwise casting on this machine: tightfit against diffusers' ``apply_layerwise_casting``
(when installed) on the same models, measured side by side in one run.

Models: a stack of transformer-like blocks (LayerNorm, Linear up 4x, GELU, Linear down,
residual) and a diffusers UNet2DModel built from a config. Storage float8_e4m3fn,
compute bf16 and fp32, at leaf, block and model granularity. For each: weights' bytes
between forwards, peak memory during a forward (live tensor bytes: weights, copies and
activations), forward latency (best of ``--repeat``, the variants interleaved so that
load on the machine hits them alike) and the relative L2 error of the output against
the float32 model.

"added" is latency over the uncast model in the same compute dtype; "vs diffusers" is
tightfit's added latency over diffusers' (target <= 0.5). diffusers offers leaf hooks
(``apply_layerwise_casting``, its default skips) or one hook on a whole module
(``apply_layerwise_casting_hook``, used here for its block and model rows: it casts the
norms too). "same as diffusers" checks that tightfit without scales computes what
diffusers computes at leaf granularity, on a model whose biases were rounded through
float8 first (diffusers stores biases in float8; tightfit keeps 1-D tensors as they are).

On an accelerator (``--device cuda``) a second table shows offloading: the stack in
bf16 resident on the device, offloaded to CPU memory with and without prefetch (the
copy of the next block overlapping the current block's compute shows as lower
latency), float8 storage offloaded, and disk storage. Peaks there are the allocator's.

Run: python benchmarks/casting.py [--device D] [--width W] [--depth D] [--tokens T] [--repeat R]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from torch import nn

from tightfit import backends
from tightfit.hooks import apply_layerwise_casting, apply_offloading, resident_bytes
from tightfit.memory import LiveTensorBytes, tensor_bytes

try:
    from diffusers import UNet2DModel
    from diffusers.hooks import apply_layerwise_casting as diffusers_casting
    from diffusers.hooks import apply_layerwise_casting_hook as diffusers_module_hook
except ImportError:  # the comparison is optional; tightfit's own figures still print
    UNet2DModel = diffusers_casting = diffusers_module_hook = None

F8 = torch.float8_e4m3fn


class Residual(nn.Sequential):
    """x + layers(x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


def stack_of_blocks(width: int, depth: int) -> nn.Sequential:
    """Blocks of LayerNorm, Linear up 4x, GELU, Linear down, with a residual around each."""
    return nn.Sequential(
        *[
            Residual(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        ]
    )


def models(args: argparse.Namespace) -> list[tuple[str, nn.Module, tuple, list[nn.Module]]]:
    """(name, float32 model, inputs, its blocks)."""
    torch.manual_seed(0)
    stack = stack_of_blocks(args.width, args.depth).eval()
    found = [(f"stack {args.depth}x{args.width}", stack, (torch.randn(2, args.tokens, args.width),), list(stack))]
    if UNet2DModel is not None:
        unet = UNet2DModel(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(64, 128),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=16,
        ).eval()
        blocks = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
        found.append(("diffusers UNet2DModel", unet, (torch.randn(1, 3, 32, 32), torch.tensor([10])), blocks))
    return found


def output(model: nn.Module, inputs: tuple) -> torch.Tensor:
    result = model(*inputs)
    return (result.sample if hasattr(result, "sample") else result).float()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def weights_of(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def peak_bytes(model: nn.Module, inputs: tuple, device: torch.device) -> int:
    """Bytes at the fullest moment of one forward, this model's weights on the device included.

    CPU: live tensor bytes. Accelerators: the allocator's peak over what was allocated
    before (every variant's weights), plus this model's resident weights.
    """
    if device.type == "cpu":
        with LiveTensorBytes("cpu", existing=weights_of(model)) as tracker:
            model(*inputs)
        return tracker.peak
    backend = backends.get(device)
    backend.synchronize(device)
    before = backend.memory(device).allocated
    backend.reset_peak_memory(device)
    model(*inputs)
    backend.synchronize(device)
    return backend.memory(device).peak - before + resident_bytes(model, device)


def variants(
    model: nn.Module, blocks: list[nn.Module], compute: torch.dtype, granularity: str, device: torch.device
) -> dict[str, nn.Module]:
    """The uncast model in ``compute`` on ``device`` and its cast versions, each its own copy."""
    plain = copy.deepcopy(model).to(device, compute)
    found = {"plain": plain}
    index = {id(m): i for i, m in enumerate(model.modules())}
    positions = [index[id(b)] for b in blocks]

    def copy_blocks(copied: nn.Module) -> list[nn.Module]:
        modules = list(copied.modules())
        return [modules[i] for i in positions]

    if diffusers_casting is not None:
        theirs = copy.deepcopy(plain)
        if granularity == "leaf":
            diffusers_casting(theirs, storage_dtype=F8, compute_dtype=compute)
        else:
            for target in copy_blocks(theirs) if granularity == "block" else [theirs]:
                diffusers_module_hook(target, F8, compute, False)
        found["diffusers"] = theirs
    for label, scale in (("tightfit", "channel"), ("tightfit unscaled", None)):
        ours = copy.deepcopy(plain)
        chosen = set(map(id, copy_blocks(ours)))
        unit = (lambda name, m: id(m) in chosen) if granularity == "block" else granularity
        apply_layerwise_casting(ours, F8, compute, granularity=unit, scale=scale)
        found[label] = ours
    return found


def same_as_diffusers(model: nn.Module, inputs: tuple, compute: torch.dtype) -> float | None:
    """Max |tightfit unscaled - diffusers| at leaf granularity on the stack, biases rounded through float8 first."""
    if diffusers_casting is None or not isinstance(model, nn.Sequential):
        return None
    rounded = copy.deepcopy(model).to(inputs[0].device, compute)
    for module in rounded.modules():
        if isinstance(module, nn.Linear):
            module.bias.data = module.bias.data.to(F8).to(compute)
    theirs, ours = copy.deepcopy(rounded), copy.deepcopy(rounded)
    diffusers_casting(theirs, storage_dtype=F8, compute_dtype=compute)
    apply_layerwise_casting(ours, F8, compute, scale=None)
    return float((output(ours, inputs) - output(theirs, inputs)).abs().max())


def interleaved_best_ms(
    models_by_label: dict[str, nn.Module], inputs: tuple, repeat: int, device: torch.device
) -> dict[str, float]:
    backend = backends.get(device)
    best = dict.fromkeys(models_by_label, float("inf"))
    for model in models_by_label.values():
        model(*inputs)  # warm up (and let offloading learn its order)
    for _ in range(repeat):
        for label, model in models_by_label.items():
            backend.synchronize(device)
            start = time.perf_counter()
            model(*inputs)
            backend.synchronize(device)
            best[label] = min(best[label], time.perf_counter() - start)
    return {label: seconds * 1e3 for label, seconds in best.items()}


def offloading_table(args: argparse.Namespace, device: torch.device) -> None:
    """The stack in bf16 on ``device``: resident against offloaded, prefetch against none."""
    torch.manual_seed(0)
    model = stack_of_blocks(args.width, args.depth).eval().to(torch.bfloat16)
    x = torch.randn(2, args.tokens, args.width, dtype=torch.bfloat16, device=device)
    found = {"resident bf16": copy.deepcopy(model).to(device)}
    for label, offload_to, prefetch, cast in (
        ("offload cpu, no prefetch", "cpu", False, False),
        ("offload cpu, prefetch", "cpu", True, False),
        ("float8 + offload cpu, prefetch", "cpu", True, True),
        ("offload disk, prefetch", "disk", True, False),
    ):
        variant = copy.deepcopy(model)
        if cast:
            apply_layerwise_casting(variant, F8, torch.bfloat16)
        apply_offloading(variant, device, offload_to=offload_to, prefetch=prefetch)
        found[label] = variant
    reference = found["resident bf16"](x).float()
    timings = interleaved_best_ms(found, (x,), args.repeat, device)
    header = f"{'stack ' + str(args.depth) + 'x' + str(args.width) + ' bf16 on ' + str(device):<34}{'on device MiB':>14}{'peak MiB':>10}{'ms':>9}{'rel L2 vs resident':>20}"
    print(header)
    print("-" * len(header))
    for label, variant in found.items():
        print(
            f"{label:<34}{resident_bytes(variant, device) / 2**20:>14.1f}{peak_bytes(variant, (x,), device) / 2**20:>10.1f}"
            f"{timings[label]:>9.1f}{relative_error(variant(x).float(), reference):>20.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--granularities", default="leaf,block,model")
    parser.add_argument(
        "--tables", default="casting,offloading", help="which tables to print (offloading: accelerators only)"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if UNet2DModel is not None:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
    torch.set_grad_enabled(False)
    backend = backends.get(args.device)
    device = backend.resolve_device(args.device)
    print(
        f"torch {torch.__version__}, {device}, {torch.get_num_threads()} CPU threads, storage float8_e4m3fn, "
        f"diffusers: {'yes' if diffusers_casting else 'not installed'}"
    )
    header = (
        f"{'model':<22}{'compute':<9}{'unit':<7}{'variant':<19}{'weights MiB':>12}{'peak MiB':>10}{'ms':>9}"
        f"{'added ms':>10}{'vs diffusers':>13}{'rel L2 err':>11}"
    )
    print(header)
    print("-" * len(header))
    notes = []
    for name, model, inputs, blocks in models(args) if "casting" in args.tables else []:
        reference = output(model.to(device), tuple(x.to(device) for x in inputs))
        for compute in (torch.bfloat16, torch.float32):
            cast_inputs = tuple(x.to(device, compute) if x.is_floating_point() else x.to(device) for x in inputs)
            match = same_as_diffusers(model, cast_inputs, compute)
            if match is not None:
                notes.append(
                    f"{name}, {str(compute).removeprefix('torch.')}: tightfit unscaled vs diffusers at leaf granularity, "
                    f"max |difference| = {match:.3g}"
                )
            for granularity in args.granularities.split(","):
                cast = variants(model, blocks, compute, granularity, device)
                timings = interleaved_best_ms(cast, cast_inputs, args.repeat, device)
                base = timings["plain"]
                added_diffusers = timings.get("diffusers", float("nan")) - base
                for label, variant in cast.items():
                    added = timings[label] - base
                    versus = (
                        added / added_diffusers
                        if label.startswith("tightfit") and added_diffusers > 0
                        else float("nan")
                    )
                    print(
                        f"{name:<22}{str(compute).removeprefix('torch.'):<9}{granularity:<7}{label:<19}"
                        f"{tensor_bytes(weights_of(variant)) / 2**20:>12.1f}{peak_bytes(variant, cast_inputs, device) / 2**20:>10.1f}"
                        f"{timings[label]:>9.1f}{added:>10.1f}{versus:>13.2f}{relative_error(output(variant, cast_inputs), reference):>11.4f}"
                    )
                del cast
    print()
    for note in notes:
        print(note)
    if device.type != "cpu" and "offloading" in args.tables:
        print()
        offloading_table(args, device)


if __name__ == "__main__":
    main()
