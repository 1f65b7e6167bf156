"""Static memory plans against measured peaks, over models built from configs.

For each model (a Llama-style causal LM, BERT, GPT-2, a diffusers UNet), inference and
one training step (the model's own loss, else the mean square of its first output, planned
and measured as one module), in one run:

- the plan of the graphs the tightfit compile backend runs (``plan_memory``, order
  "best"): arena, lower bound, their ratio, the order kept;
- eager: the predicted peak (``runtime="eager"``: the module run once on fake tensors)
  against the peak measured in a real eager call (live tensor bytes, counted by
  ``tightfit.memory.LiveTensorBytes``; weights and inputs excluded from both);
- compiled: the predicted peak of the written order (what the compile backend runs,
  splits as FX modules) against the peak measured in a real call of
  ``torch.compile(model, backend=tightfit.graph.compiler(execution="fx"))``;
- arena: the predicted peak of arena execution (``runtime="arena"``: each graph's
  execution arena counted whole, plus what is allocated outside it) against the peak
  measured in a real call of ``torch.compile(model, backend=compiler(memory="arena"))``;
  the execution arenas' sizes (forward + backward) and the bytes of all the tensors
  allocated outside them (a sum over the step, not a peak);
- inductor's own estimate (``torch._inductor.memory``'s log of its chosen order), the
  largest over the graphs it compiles (forward and backward apart), where obtainable.

Run: ``PYTHONPATH=src python benchmarks/memory_plan.py`` (``--no-inductor`` skips the
slow inductor compiles; ``--json PATH`` writes the rows).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._functorch.config
import torch._inductor.config

import tightfit
from tightfit.graph import compiler
from tightfit.memory import LiveTensorBytes
from tightfit.memory.compiled import compiled_peak

MiB = 1024 * 1024


@dataclass
class Case:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[bool], tuple[tuple, dict]]  # training -> (args, kwargs)


def _named_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Name the loss: transformers logs a warning otherwise, which breaks dynamo's graph in two."""
    model.loss_type = "ForCausalLM"
    return model


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _named_loss(LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)))


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=8000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                intermediate_size=2048, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return _named_loss(GPT2LMHeadModel(GPT2Config(vocab_size=8000, n_embd=512, n_layer=4, n_head=8, n_positions=512,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)))


def _unet() -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(64, 128), cross_attention_dim=128, attention_head_dim=8,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=32)


def _tokens(batch: int, seq: int, labels: bool, cache: bool = True) -> Callable[[bool], tuple[tuple, dict]]:
    def make(training: bool) -> tuple[tuple, dict]:
        ids = torch.randint(0, 8000, (batch, seq))
        kwargs = {"use_cache": False} if cache else {}
        if training and labels:
            kwargs["labels"] = ids
        return (ids,), kwargs
    return make


def _unet_inputs(training: bool) -> tuple[tuple, dict]:
    return (torch.randn(2, 4, 32, 32), torch.tensor([10, 500]), torch.randn(2, 77, 128)), {"return_dict": False}


CASES = {
    "llama": Case("Llama-style causal LM (4 layers, d 512, GQA 8/4), batch 2 x 256", _llama, _tokens(2, 256, True)),
    "bert": Case("BERT (4 layers, d 512), batch 4 x 256", _bert, _tokens(4, 256, False, cache=False)),
    "gpt2": Case("GPT-2 (4 layers, d 512), batch 2 x 256", _gpt2, _tokens(2, 256, True)),
    "unet": Case("diffusers UNet2DCondition (64/128 ch, 32x32 latents), batch 2", _unet, _unet_inputs),
}


def _loss(out) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    first = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
    return first.float().square().mean()


class WithLoss(torch.nn.Module):
    """A model's training step as one module: its own loss, else the mean square of its first output.

    Planned and measured alike, so that both see the same program.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return _loss(self.model(*args, **kwargs))


def _step(model, args, kwargs, training: bool) -> Callable[[], None]:
    def run() -> None:
        if training:
            model.zero_grad(set_to_none=True)
            model(*args, **kwargs).backward()
        else:
            with torch.no_grad():
                model(*args, **kwargs)
    return run


def eager_peak(model, args, kwargs, training: bool) -> int:
    """Peak live tensor bytes created by one eager call (training: forward, loss, backward, grads kept)."""
    run = _step(model, args, kwargs, training)
    run()  # warm up (lazy initializations)
    model.zero_grad(set_to_none=True)
    with LiveTensorBytes() as tracker:
        run()
    return tracker.peak


def compiled_run_peak(model, args, kwargs, training: bool, memory: str = "allocator") -> int:
    """The same for the tightfit compile backend (FX execution, or arena execution), from its first split on."""
    compiled = torch.compile(model, backend=compiler(execution="fx", memory=memory))
    run = _step(compiled, args, kwargs, training)
    run()  # compile outside the measurement
    model.zero_grad(set_to_none=True)
    return compiled_peak(run)


class _InductorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.graphs: list[dict[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Reordering for peak memory"):
            self.graphs.append({})
        found = re.match(r"(\w+) peak memory: (\d+)", message)
        if found and self.graphs:
            self.graphs[-1][found.group(1)] = int(found.group(2))


def inductor_estimate(model, args, kwargs, training: bool) -> int | None:
    """Inductor's estimated peak of the order it keeps, the largest over the graphs it compiles."""
    torch._dynamo.reset()
    logger = logging.getLogger("torch._inductor.memory")
    handler = _InductorLog()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # read by our handler, not printed by torch's
    try:
        uncached = torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False)
        no_aot_cache = torch._functorch.config.patch(enable_autograd_cache=False)
        with uncached, no_aot_cache:  # a cached graph skips the scheduler, and its log
            _step(torch.compile(model, backend="inductor"), args, kwargs, training)()
    except Exception as error:  # report, do not stop the table
        print(f"  inductor failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        return None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        torch._dynamo.reset()
    estimates = [min(graph.values()) for graph in handler.graphs if graph]
    return max(estimates) if estimates else None


def row(key: str, training: bool, with_inductor: bool) -> dict:
    case = CASES[key]
    torch.manual_seed(0)
    model = case.build().train(training)
    if training:
        model = WithLoss(model)
    args, kwargs = case.inputs(training)
    started = time.perf_counter()
    plan = tightfit.plan_memory(model, *args, kwargs=kwargs, training=training, backend="cpu")
    plan_seconds = time.perf_counter() - started
    plan.verify()
    written = tightfit.plan_memory(model, *args, kwargs=kwargs, training=training, backend="cpu", order="written")
    eager = tightfit.plan_memory(model, *args, kwargs=kwargs, training=training, backend="cpu", runtime="eager")
    arena = tightfit.plan_memory(model, *args, kwargs=kwargs, training=training, backend="cpu", runtime="arena")
    arena.verify()
    device, written_device, eager_device = plan.devices["cpu"], written.devices["cpu"], eager.devices["cpu"]
    measured_eager = eager_peak(model, args, kwargs, training)
    torch._dynamo.reset()
    measured_compiled = compiled_run_peak(model, args, kwargs, training)
    torch._dynamo.reset()
    measured_arena = compiled_run_peak(model, args, kwargs, training, memory="arena")
    torch._dynamo.reset()

    estimate = inductor_estimate(model, args, kwargs, training) if with_inductor else None
    return {
        "model": key, "mode": "train" if training else "infer", "steps": len(plan.timeline.steps),
        "weights": device.weights_bytes, "arena": device.arena_bytes, "lower_bound": device.lower_bound_bytes,
        "ratio": device.ratio, "order": "/".join(plan.orders.values()), "placement": device.placement,
        "written_lower_bound": written_device.lower_bound_bytes,
        "eager_predicted": eager_device.live_peak_bytes, "eager_measured": measured_eager,
        "compiled_predicted": written_device.live_peak_bytes, "compiled_measured": measured_compiled,
        "arena_predicted": arena.devices["cpu"].live_peak_bytes, "arena_measured": measured_arena,
        "run_arenas": sum(size for sizes in arena.run_arenas.values() for size in sizes.values()),
        "outside": sum(entry.nbytes for entry in arena.outside),
        "inductor_estimate": estimate, "plan_seconds": plan_seconds,
    }


def _pct(measured: int, predicted: int) -> str:
    return f"{(measured - predicted) / predicted * 100:+.1f}%" if predicted else "-"


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':6} {'mode':5} {'steps':>5} {'weights':>8} {'arena':>8} {'bound':>8} {'ratio':>6} {'order':>16}  "
              f"{'eager pred':>10} {'meas':>8} {'err':>7}  {'fx pred':>8} {'meas':>8} {'err':>7}  "
              f"{'arena pred':>10} {'meas':>8} {'err':>7} {'arenas':>7} {'outside':>7}  {'inductor':>8} {'plan s':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        inductor = f"{r['inductor_estimate'] / MiB:8.1f}" if r["inductor_estimate"] is not None else f"{'-':>8}"
        print(f"{r['model']:6} {r['mode']:5} {r['steps']:5d} {r['weights'] / MiB:8.1f} {r['arena'] / MiB:8.1f} "
              f"{r['lower_bound'] / MiB:8.1f} {r['ratio']:6.3f} {r['order']:>16}  "
              f"{r['eager_predicted'] / MiB:10.1f} {r['eager_measured'] / MiB:8.1f} {_pct(r['eager_measured'], r['eager_predicted']):>7}  "
              f"{r['compiled_predicted'] / MiB:8.1f} {r['compiled_measured'] / MiB:8.1f} "
              f"{_pct(r['compiled_measured'], r['compiled_predicted']):>7}  "
              f"{r['arena_predicted'] / MiB:10.1f} {r['arena_measured'] / MiB:8.1f} "
              f"{_pct(r['arena_measured'], r['arena_predicted']):>7} {r['run_arenas'] / MiB:7.1f} {r['outside'] / MiB:7.1f}  "
              f"{inductor} {r['plan_seconds']:6.1f}")
    print("MiB; arena and bound: the compile backend's graphs in the order kept; eager: plan runtime='eager' against a "
          "real eager call;\nfx: plan of the written order against torch.compile(backend=tightfit, execution='fx'); "
          "arena: plan runtime='arena' against\ntorch.compile(backend=tightfit, memory='arena'); arenas: "
          "the execution arenas' bytes; outside: bytes of all tensors allocated outside them (a sum, not a peak);\n"
          "inductor: its own estimate (largest graph); weights and inputs excluded from every peak.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--no-inductor", action="store_true", help="skip inductor's estimate (slow compiles)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    rows = []
    for key in args.models.split(","):
        if key not in CASES:
            raise SystemExit(f"unknown model {key!r}; known: {', '.join(CASES)}")
        print(f"{key}: {CASES[key].name}", flush=True)
        for training in (False, True):
            rows.append(row(key, training, not args.no_inductor))
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
