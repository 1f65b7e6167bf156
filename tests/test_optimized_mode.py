"""Bad inputs raise the documented errors under ``python -O`` too (no asserts do the work)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import torch, tightfit
from tightfit.app.run import RunOptions
from tightfit.memory import measure
import tightfit.quant as quant
import tightfit.hooks as hooks
import tightfit.hooks.activations
import tightfit.fitting.training_plan
layer = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4))
def twice():
    model = layer()
    hooks.apply_layerwise_casting(model, torch.float8_e4m3fn, torch.float32)
    hooks.apply_layerwise_casting(model, torch.float8_e4m3fn, torch.float32)
import tightfit.graph
import tightfit.graph.alloc
import tightfit.fitting, tightfit.fitting.traced, tightfit.memory, tightfit.app.generation, tightfit.optim
FIG = dict(backend="cpu", device_name="test", torch_version=torch.__version__, matmul_flops=1e10, device_bandwidth=1e10,
           host_to_device_bandwidth=None, disk_bandwidth=1e9, decode_seconds=dict.fromkeys(("bfloat16", "float8", "8bit", "int8", "nf4", "fp4"), 0.0))
import torch.fx
import os, tempfile, tightfit.app.models
class Branches(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x
def list_config():
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as file:
        file.write("[1, 2]")
    return tightfit.app.models.folder_kind(folder)
def bad_shard():
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "model.safetensors"), "wb") as file:
        file.write((2).to_bytes(8, "little") + b"[]")
    return tightfit.loading.Checkpoint(folder)
def strict_from(value):
    os.environ["TIGHTFIT_STRICT"] = value
    try:
        tightfit.is_strict()
    finally:
        del os.environ["TIGHTFIT_STRICT"]
assert False, "asserts must be off under -O"
checks = [
    (lambda: tightfit.ops.cast([1.0], torch.bfloat16), TypeError),
    (lambda: tightfit.ops.cast(torch.ones(2), "bf16"), TypeError),
    (lambda: tightfit.ops.cast(torch.ones(2, dtype=torch.int32), torch.float8_e4m3fn), ValueError),
    (lambda: tightfit.ops.cast(torch.ones(2), torch.bfloat16, out=torch.empty(3, dtype=torch.bfloat16)), ValueError),
    (lambda: tightfit.ops.cast(torch.ones(2), torch.bfloat16, out=torch.empty(2)), ValueError),
    (lambda: tightfit.backends.get(3), TypeError),
    (lambda: tightfit.backends.get("nonesuch"), ValueError),
    (lambda: tightfit.backends.get("cpu").memory("cuda:0"), ValueError),
    (lambda: tightfit.backends.get("cpu").device(-1), ValueError),
    (lambda: tightfit.ops.get_op(1), TypeError),
    (lambda: RunOptions(repeat=0), ValueError),
    (lambda: RunOptions(model=1), TypeError),
    (lambda: measure(lambda: None, "cpu", repeat=0), ValueError),
    (lambda: tightfit.ops.quantize_blockwise(torch.ones(4), blocksize=0), ValueError),
    (lambda: tightfit.ops.quantize_4bit(torch.tensor([float("nan"), 1.0])), ValueError),
    (lambda: tightfit.ops.dequantize_4bit(torch.zeros(4, dtype=torch.uint8), torch.ones(1), shape=[9]), ValueError),
    (lambda: tightfit.ops.int8_linear_matmul(torch.ones(2, 3), torch.ones(2, 3)), TypeError),
    (lambda: torch.ops.tightfit.cast_into(torch.zeros(1 << 16).to(torch.float8_e4m3fn), torch.empty(16, dtype=torch.bfloat16)), ValueError),
    (lambda: torch.ops.tightfit.dequantize_4bit(torch.zeros(8, dtype=torch.uint8), torch.ones(1), 64, "nf4", [1000, 1000], torch.float32), ValueError),
    (lambda: tightfit.ops.get_op("gemv_4bit")(torch.ones(1, 4), torch.zeros(2, dtype=torch.uint8), [1, 4], torch.ones(1), 0, "nf4"), ValueError),
    (lambda: tightfit.ops.get_op("gemv_4bit_int8")(torch.ones(1, 4), torch.zeros(1, dtype=torch.uint8), [1, 4], torch.ones(1), 64, "nf4"), ValueError),
    (lambda: tightfit.ops.get_op("gemv_blockwise_int8")(torch.ones(1, 4), torch.zeros(1, 4, dtype=torch.uint8), torch.ones(1), tightfit.ops.dynamic_map(), 0), ValueError),
    (lambda: quant.Blockwise8Config(compute="int4"), ValueError),
    (lambda: torch.ops.tightfit.quantize_blockwise(torch.ones(4), tightfit.ops.dynamic_map()[:16], 64), ValueError),
    (lambda: quant.NF4Config(blocksize=48), ValueError),
    (lambda: quant.NF4Config(compute="int4"), ValueError),
    (lambda: quant.quantize_(torch.nn.Linear(2, 2), quant.NF4Config()), ValueError),
    (lambda: quant.QuantState.from_dict({"absmax": torch.ones(1)}), ValueError),
    (lambda: hooks.apply_layerwise_casting(layer(), torch.int8, torch.float32), ValueError),
    (lambda: hooks.apply_layerwise_casting(layer(), torch.float8_e4m3fn, torch.int32), ValueError),
    (lambda: hooks.apply_layerwise_casting(layer(), torch.float8_e4m3fn, torch.float32, skip="[bad"), ValueError),
    (lambda: hooks.apply_layerwise_casting(layer(), "float8", torch.float32), TypeError),
    (twice, ValueError),
    (lambda: hooks.apply_offloading(layer(), "nonesuch"), ValueError),
    (lambda: hooks.apply_offloading(layer(), "cuda:99"), (RuntimeError, ValueError)),  # no such device
    (lambda: hooks.apply_offloading(layer(), "cpu", offload_to="tape"), ValueError),
    (lambda: hooks.HookRegistry.of(torch.nn.Linear(2, 2)).remove("none"), ValueError),
    (lambda: RunOptions(storage_dtype="int4"), ValueError),
    (lambda: RunOptions(quant="nf4", storage_dtype="float8_e4m3fn"), ValueError),
    (lambda: RunOptions(offload="tape"), ValueError),
    (lambda: RunOptions(budget="0"), ValueError),
    (lambda: RunOptions(budget="nan"), ValueError),
    (lambda: RunOptions(budget=True), TypeError),
    (lambda: RunOptions(budget="40MB", quant="nf4"), ValueError),
    (lambda: RunOptions(allow="keep"), ValueError),
    (lambda: RunOptions(budget="40MB", allow="keep,tape"), ValueError),
    (lambda: RunOptions(budget="40MB", allow=3), TypeError),
    (lambda: tightfit.hint(schedule="wide"), ValueError),
    (lambda: tightfit.hint(slices=0), ValueError),
    (lambda: tightfit.hint(slices="8"), TypeError),
    (lambda: tightfit.hint(tile=4), ValueError),
    (lambda: tightfit.hint(**{"acme.tile": [1]}), TypeError),
    (lambda: tightfit.hint(device=3), TypeError),
    (lambda: tightfit.hints_of(3), TypeError),
    (lambda: tightfit.graph.compiler(execution="jit"), ValueError),
    (lambda: tightfit.graph.compiler(backends=["cpu"]), TypeError),
    (lambda: tightfit.graph.compiler(memory="pool"), ValueError),
    (lambda: tightfit.graph.compiler(memory=None), TypeError),
    (lambda: tightfit.graph.compiler(memory="arena", execution="inductor"), ValueError),
    (lambda: tightfit.graph.CompileOptions.from_options({"memory": "heap"}), ValueError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2), runtime="arena", order="depth-first"), ValueError),
    (lambda: tightfit.graph.CompileOptions.from_options({"fast": 1}), ValueError),
    (lambda: tightfit.graph.observe_splits(3).__enter__(), TypeError),
    (lambda: tightfit.plan_memory(lambda x: x, torch.ones(2)), TypeError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2), training="yes"), TypeError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2), order="random"), ValueError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2), runtime="jit"), ValueError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2), alignment=3), ValueError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2), backend="nonesuch"), ValueError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2), kwargs=3), TypeError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2).requires_grad_(False), torch.ones(2, 2), training=True), ValueError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2)).plot("plan.svg"), ValueError),
    (lambda: tightfit.plan_memory(torch.nn.Linear(2, 2), torch.ones(2, 2)).live_bytes("cuda:7"), ValueError),
    (lambda: tightfit.graph.alloc.place_arena("cpu", [], alignment=0), ValueError),
    (lambda: tightfit.graph.alloc.plan_graph(torch.fx.symbolic_trace(torch.nn.ReLU()), order="sideways"), ValueError),
    (lambda: tightfit.graph.alloc.graph_timeline(torch.fx.symbolic_trace(torch.nn.ReLU()), order="relu"), TypeError),
    (lambda: tightfit.fit(layer(), [torch.ones(2, 4), 3], "1MB"), TypeError),
    (lambda: tightfit.fitting.FitPlan.from_json(tightfit.fit(layer(), torch.ones(2, 4), "1MB", calibration=tightfit.fitting.Calibration(**FIG)).to_json().replace('"applies_nothing": true', '"applies_nothing": "yes"')), ValueError),
    (lambda: tightfit.fitting.held_bytes(layer(), "bogus"), ValueError),
    (lambda: tightfit.fitting.Allow(hints="yes"), TypeError),
    (lambda: tightfit.fitting.add_hints(layer(), {"nope": {"slices": 2}}), ValueError),
    (lambda: tightfit.fitting.add_hints(layer(), {"": {"slices": 0}}), ValueError),
    (lambda: tightfit.fitting.held_bytes(layer(), 5), TypeError),
    (lambda: tightfit.fitting.Calibration(**{**FIG, "decode_seconds": {**FIG["decode_seconds"], "gguf": 0.0}}), ValueError),
    (lambda: tightfit.fit(layer(), torch.ones(2, 4), "1MB", calibration=tightfit.fitting.Calibration(**{**FIG, "backend": "cuda"})), ValueError),
    (lambda: tightfit.fitting.Calibration(**{**FIG, "token_seconds": {"keep": 1e-10}}), ValueError),
    (lambda: tightfit.fitting.Calibration(**{**FIG, "cached_read_bandwidth": 0}), ValueError),
    (lambda: tightfit.fitting.Calibration(**{**FIG, "token_seconds": {"float32": {"keep": 0}}}), ValueError),
    (lambda: tightfit.fitting.traced.DecodeTrace("script", 5, "model", 0), TypeError),
    (lambda: tightfit.fitting.traced.DecodeTrace(print, 0, "model", 0), ValueError),
    (lambda: tightfit.fitting.traced.DecodeTrace(print, 5, "", 0), ValueError),
    (lambda: tightfit.fit(layer(), torch.ones(2, 4), "1MB", calibration=tightfit.fitting.Calibration(**FIG), decode=3, decode_steps=1), TypeError),
    (lambda: tightfit.fit(layer(), torch.ones(2, 4), "1MB", calibration=tightfit.fitting.Calibration(**FIG), decode=tightfit.fitting.traced.DecodeTrace(print, 5, "model", 0)), ValueError),
    (lambda: tightfit.fitting.FitPlan.from_json(tightfit.fit(layer(), torch.ones(2, 4), "1MB", calibration=tightfit.fitting.Calibration(**FIG)).to_json().replace('"phase_peaks": {}', '"phase_peaks": {"prefill": 1}')), ValueError),
    (lambda: tightfit.fitting.FitPlan.from_json(tightfit.fit(layer(), torch.ones(2, 4), "1MB", calibration=tightfit.fitting.Calibration(**FIG)).to_json().replace('"kv_cache": {}', '"kv_cache": {"format": "model"}')), ValueError),
    (lambda: tightfit.memory.AllocatedBytes("bogus", read=lambda: 0), ValueError),
    (lambda: tightfit.memory.mark(3), TypeError),
    (lambda: tightfit.app.generation.generate_greedy(None, torch.ones(1, 2, dtype=torch.long), 1, synchronize=3), TypeError),
    (lambda: tightfit.memory.allocated_peak(lambda: tightfit.memory.allocated_peak(lambda: None)), RuntimeError),
    (lambda: tightfit.plan_memory(Branches(), torch.ones(2)), ValueError),
    (list_config, ValueError),
    (bad_shard, ValueError),
    (lambda: tightfit.loading.Checkpoint(3), TypeError),
    (lambda: tightfit.load(3, "1MB"), TypeError),
    (lambda: tightfit.load(tempfile.mkdtemp(), "1MB"), ValueError),
    (lambda: tightfit.loading.skeleton(tightfit.app.models.default_model_dir(), "seq2seq"), ValueError),
    (lambda: RunOptions(reference="no"), TypeError),
    (lambda: strict_from("ture"), ValueError),
    (lambda: tightfit.optim.Adam([torch.zeros(8)], lr=-1.0), ValueError),
    (lambda: tightfit.optim.Adam([torch.zeros(8)], optim_bits=4), ValueError),
    (lambda: tightfit.optim.Adam([torch.zeros(8)]).load_state_dict({"state": {0: {"step": 1}}, "param_groups": [{"params": [0]}]}), ValueError),
    (lambda: tightfit.ops.optimizer_update_32bit("adam", torch.zeros(4), torch.zeros(4), torch.zeros(3), torch.zeros(4), beta1=0.9, step=1, lr=1e-3), ValueError),
    (lambda: tightfit.ops.optimizer_update_8bit_blockwise("lion", torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.uint8), torch.zeros(1), torch.zeros(256), beta1=0.9, step=0, lr=1e-3), ValueError),
    (lambda: tightfit.fit(layer(), torch.ones(1, 4), "1MB", training=True, optimizer="adamw"), ValueError),
    (lambda: tightfit.fit(layer(), torch.ones(1, 4), "1MB", training=True, decode_steps=2), ValueError),
    (lambda: hooks.activations.apply_activation_policy(layer(), {"0": "drop"}), ValueError),
    (lambda: hooks.activations.apply_activation_policy(layer(), {"0": "offload"}), ValueError),
    (lambda: quant.add_lora(layer(), rank=0), ValueError),
    (lambda: tightfit.fitting.training_plan.TrainingPlan.from_json("[]"), ValueError),
    (lambda: tightfit.memory.measure_training_step(layer(), (), {}, None, "cpu"), TypeError),
]
for index, (call, expected) in enumerate(checks):
    try:
        call()
    except expected:
        continue
    except Exception as error:
        raise SystemExit(f"check {index}: raised {type(error).__name__}, expected {expected}: {error}")
    raise SystemExit(f"check {index}: nothing raised, expected {expected}")
print(f"{len(checks)} checks raised as documented")
"""


def test_bad_inputs_raise_under_python_O():
    done = subprocess.run([sys.executable, "-O", "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "120 checks raised as documented" in done.stdout
