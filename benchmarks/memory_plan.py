"""Static memory plans against the allocator, for every runtime a plan predicts.

For each model (a Llama-style causal LM, BERT, GPT-2, a diffusers UNet), inference and
one training step (the model's own loss, else the mean square of its first output, planned
and measured as one module), in one run:

- the plan of the graphs the tightfit compile backend runs (``plan_memory``, order
  "best"): arena, lower bound, their ratio, the order kept;
- per runtime, the predicted peak against the allocator's own count of one real call
  (``tightfit.memory.allocated_peak``: the CPU allocator's allocation events, so also
  what a kernel allocates and frees inside one op; weights and inputs excluded from both):
  - eager: ``plan_memory(runtime="eager")`` against a plain call of the module;
  - fx: ``plan_memory(order="written")`` against ``torch.compile(model,
    backend=tightfit.graph.compiler(execution="fx"))``;
  - arena: ``plan_memory(runtime="arena")`` against ``torch.compile(model,
    backend=tightfit.graph.compiler(memory="arena"))``; with the execution arenas' sizes
    (forward + backward) and the bytes of all the tensors allocated outside them (a sum
    over the step, not a peak);
  - auto: the same written-order plan against ``torch.compile(model, backend="tightfit")``
    with its default execution (inductor compiles the splits). No plan covers it
    (``tightfit.memory.NOT_COVERED``): the ratio shows by how much it is off;
- inductor's own estimate (``torch._inductor.memory``'s log of its chosen order), the
  largest over the graphs it compiles (forward and backward apart), where obtainable.

Run: ``PYTHONPATH=src python benchmarks/memory_plan.py`` (``--no-inductor`` skips the
slow inductor compiles: the auto column and inductor's estimate; ``--json PATH`` writes
the rows).
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
from tightfit.memory import allocated_peak

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

    return _named_loss(
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=8000,
                hidden_size=512,
                intermediate_size=1376,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                max_position_embeddings=512,
            )
        )
    )


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(
        BertConfig(
            vocab_size=8000,
            hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            intermediate_size=2048,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return _named_loss(
        GPT2LMHeadModel(
            GPT2Config(
                vocab_size=8000,
                n_embd=512,
                n_layer=4,
                n_head=8,
                n_positions=512,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    )


def _unet() -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(64, 128),
        cross_attention_dim=128,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        norm_num_groups=32,
    )


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
    """One call (training: forward, loss, backward; the gradients stay, as ``.grad``)."""

    def run() -> None:
        if training:
            model(*args, **kwargs).backward()
        else:
            with torch.no_grad():
                model(*args, **kwargs)

    return run


def allocator_peak(model, run_model, args, kwargs, training: bool) -> int:
    """The allocator's peak during one call of ``run_model`` (``model`` compiled, or itself), after a
    warm-up call (lazy initializations, compiling); the gradients are dropped before the call, outside
    the measurement (freeing them inside would hide as many bytes)."""
    run = _step(run_model, args, kwargs, training)
    run()
    model.zero_grad(set_to_none=True)
    peak = allocated_peak(run)
    model.zero_grad(set_to_none=True)
    return peak


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
    measured = {"eager": allocator_peak(model, model, args, kwargs, training)}
    backends = {"fx": compiler(execution="fx"), "arena": compiler(memory="arena")}
    if with_inductor:
        backends["auto"] = "tightfit"
    for runtime, backend in backends.items():
        torch._dynamo.reset()
        measured[runtime] = allocator_peak(model, torch.compile(model, backend=backend), args, kwargs, training)
    torch._dynamo.reset()

    estimate = inductor_estimate(model, args, kwargs, training) if with_inductor else None
    return {
        "model": key,
        "mode": "train" if training else "infer",
        "steps": len(plan.timeline.steps),
        "weights": device.weights_bytes,
        "arena": device.arena_bytes,
        "lower_bound": device.lower_bound_bytes,
        "ratio": device.ratio,
        "order": "/".join(plan.orders.values()),
        "placement": device.placement,
        "written_lower_bound": written_device.lower_bound_bytes,
        "eager_predicted": eager_device.live_peak_bytes,
        "eager_measured": measured["eager"],
        "fx_predicted": written_device.live_peak_bytes,
        "fx_measured": measured["fx"],
        "arena_predicted": arena.devices["cpu"].live_peak_bytes,
        "arena_measured": measured["arena"],
        "auto_predicted": written_device.live_peak_bytes,
        "auto_measured": measured.get("auto"),
        "run_arenas": sum(size for sizes in arena.run_arenas.values() for size in sizes.values()),
        "outside": sum(entry.nbytes for entry in arena.outside),
        "inductor_estimate": estimate,
        "plan_seconds": plan_seconds,
    }


def _ratio(measured: int | None, predicted: int) -> str:
    return f"{measured / predicted:.3f}" if predicted and measured is not None else "-"


def _mib(nbytes: int | None) -> str:
    return f"{nbytes / MiB:.1f}" if nbytes is not None else "-"


def print_table(rows: list[dict]) -> None:
    runtimes = ("eager", "fx", "arena", "auto")
    header = (
        f"{'model':6} {'mode':5} {'steps':>5} {'weights':>7} {'arena':>6} {'bound':>6} {'ratio':>6} {'order':>19}  "
        + "  ".join(f"{name + ' pred':>10} {'alloc':>6} {'x':>5}" for name in runtimes)
        + f"  {'arenas':>6} {'outside':>7} {'inductor':>8} {'plan s':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        cells = "  ".join(
            f"{_mib(r[name + '_predicted']):>10} {_mib(r[name + '_measured']):>6} "
            f"{_ratio(r[name + '_measured'], r[name + '_predicted']):>5}"
            for name in runtimes
        )
        print(
            f"{r['model']:6} {r['mode']:5} {r['steps']:5d} {_mib(r['weights']):>7} {_mib(r['arena']):>6} "
            f"{_mib(r['lower_bound']):>6} {r['ratio']:6.3f} {r['order']:>19}  {cells}  "
            f"{_mib(r['run_arenas']):>6} {_mib(r['outside']):>7} {_mib(r['inductor_estimate']):>8} {r['plan_seconds']:6.1f}"
        )
    print(
        "MiB; arena and bound: the compile backend's graphs in the order kept; pred: the plan's peak, alloc: "
        "tightfit.memory.allocated_peak of one real call,\nx: alloc / pred. eager: runtime='eager' against a plain "
        "call; fx: order='written' against compiler(execution='fx'); arena: runtime='arena' against\n"
        "compiler(memory='arena'); auto: the fx plan against backend='tightfit' as it is (inductor compiles "
        "the splits: not covered by any plan);\narenas: the execution arenas' bytes; outside: bytes of all "
        "tensors allocated outside them (a sum, not a peak); inductor: its own estimate (largest graph);\n"
        "weights and inputs excluded from every peak."
    )


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
