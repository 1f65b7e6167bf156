"""A broken config.json, shard index or saved plan is refused with one ValueError naming
the file, the key and what is accepted, on every path that reads it: tightfit.load,
plan_folder, skeleton, and the real ``tightfit run``, ``tightfit fit`` and ``tightfit
plan`` commands (exit status 2, one line on stderr, no traceback) (D7, D9). A config that
is valid is read as transformers reads it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tightfit
from tightfit.app import cli
from tightfit.loading import CAUSAL_LM, folder_kind, plan_folder, skeleton
from tightfit.loading._config import config_errors
from zoo.lm import figures

transformers = pytest.importorskip("transformers")

IDS = torch.arange(3, 15).unsqueeze(0)
RUN = ["--repeat", "1", "--max-new-tokens", "1"]
DEEP = object()  # config.json nested 100,000 deep


def _with(folder: Path, tmp_path: Path, changes) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    config = copy / "config.json"
    if changes is DEEP:
        config.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
        return copy
    document = json.loads(config.read_text())
    for key, value in changes.items():
        if value is None and key != "quantization_config":
            document.pop(key, None)
        else:
            document[key] = value
    config.write_text(json.dumps(document))
    return copy


#: (changes to the tiny Llama's config.json, what the error must say after "config.json: ")
BROKEN_CONFIGS = [
    ({"architectures": 5}, "architectures=5 is not accepted; accepted: a list of class names"),
    ({"architectures": [5]}, "architectures=[5] is not accepted"),
    ({"architectures": {"a": 1}}, "architectures={'a': 1} is not accepted"),
    (
        {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
        "num_attention_heads=3 is not accepted; accepted: a divisor of hidden_size=32",
    ),
    (
        {"num_attention_heads": 5, "num_key_value_heads": 1},
        "transformers",
    ),  # with a head_dim: transformers' own check, named
    ({"num_attention_heads": 0}, "num_attention_heads=0 is not accepted; accepted: an int > 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0 is not accepted; accepted: an int > 0"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 is not accepted; accepted: a divisor of num_attention_heads=4"),
    ({"hidden_size": "32"}, "hidden_size='32' is not accepted; accepted: an int > 0"),
    ({"vocab_size": 0}, "vocab_size=0 is not accepted"),
    ({"intermediate_size": 0}, "intermediate_size=0 is not accepted"),
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1 is not accepted; accepted: an int from 0 to 4096"),
    ({"num_hidden_layers": 2**64}, "num_hidden_layers=18446744073709551616 is not accepted"),  # built forever
    ({"hidden_act": "nonesuch"}, "hidden_act='nonesuch' is not accepted; accepted: gelu,"),
    ({"hidden_act": 3}, "hidden_act=3 is not accepted"),
    (
        {"rope_parameters": {"rope_type": "nonesuch", "rope_theta": 10000.0}},
        "rope_parameters.rope_type='nonesuch' is not accepted; accepted: ",
    ),
    (
        {"rope_parameters": None, "rope_scaling": {"type": "nonesuch", "factor": 2.0}},
        "rope_scaling.type='nonesuch' is not accepted",
    ),
    (
        {"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
        "rope_parameters.rope_theta='x' is not accepted",
    ),
    ({"pad_token_id": 10**6}, "pad_token_id=1000000 is not accepted; accepted: null or an int from -30522 to 30521"),
    ({"quantization_config": [1]}, "quantization_config=[1] is not accepted; accepted: a JSON object"),
    ({"quantization_config": None}, "quantization_config=None is not accepted"),
    ({"head_dim": 7}, "transformers"),  # transformers' RoPE check, named
    ({"_attn_implementation": "nonesuch"}, "transformers"),  # raised while building the model, named
    ({"tie_word_embeddings": "yes"}, "transformers"),
    ({"dtype": "int8"}, "dtype=torch.int8 is not accepted; accepted: float32, float16, bfloat16"),
    (DEEP, "is not valid JSON: nested too deeply"),
]


def _id(case) -> str:
    changes, _ = case
    return "deep" if changes is DEEP else ",".join(f"{k}={v!r:.20}" for k, v in changes.items())


@pytest.mark.parametrize("changes, message", BROKEN_CONFIGS, ids=[_id(c) for c in BROKEN_CONFIGS])
def test_a_broken_config_is_one_value_error_naming_it_on_every_library_path(tiny_llama, tmp_path, changes, message):
    folder = _with(tiny_llama, tmp_path, changes)
    where = re.escape(str(folder / "config.json"))
    for call in (
        lambda: tightfit.load(folder, 40_000_000, calibration=figures()),
        lambda: plan_folder(folder, 40_000_000, calibration=figures()),
        lambda: skeleton(folder, "encoder"),
    ):
        with pytest.raises(ValueError, match=rf"^{where}.*{re.escape(message)}") as refused:
            call()
        assert "\n" not in str(refused.value).strip()
        if message == "transformers":  # transformers' own error, chained
            assert refused.value.__cause__ is not None


def test_architectures_as_one_name_builds_the_causal_lm_as_transformers_does(tiny_llama, tmp_path, capsys):
    folder = _with(tiny_llama, tmp_path, {"architectures": "LlamaForCausalLM"})
    assert folder_kind(folder) == CAUSAL_LM
    model, config = skeleton(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and config.architectures == ["LlamaForCausalLM"]
    loaded, _ = tightfit.load(folder, 40_000_000, example_inputs={"input_ids": IDS}, calibration=figures())
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        assert torch.equal(loaded(IDS).logits, reference(IDS).logits)
    assert cli.main(["run", "--model", str(folder), *RUN]) == 0
    assert "generat" in capsys.readouterr().out.lower()


def test_an_error_of_tightfit_s_own_code_is_not_disguised_as_a_config_error(tiny_llama, monkeypatch):
    def bug(module, name, param):
        raise KeyError("a bug in tightfit")

    monkeypatch.setattr(torch.nn.Module, "register_parameter", bug)  # called by tightfit's hook while building
    with pytest.raises(KeyError, match="a bug in tightfit"):
        skeleton(tiny_llama)
    monkeypatch.undo()
    with pytest.raises(KeyError, match="plain"), config_errors(Path("config.json"), "build"):
        raise KeyError("plain")
    with pytest.raises(ValueError, match=r"^config.json: transformers .* cannot read it from it: ValueError"):
        with config_errors(Path("config.json"), "read it"):
            transformers.AutoConfig.for_model("nonesuch-model-type")


# -- saved plans -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory):
    model, plan = tightfit.load(
        tiny_llama,
        9_320_000,
        example_inputs={"input_ids": IDS},
        calibration=figures(),
        allow={"storage": ["keep", "nf4"], "placement": ["device"]},
    )
    return tightfit.save(model, plan, tmp_path_factory.mktemp("saved") / "saved", source=tiny_llama), plan


def _edit_plan(saved, tmp_path, edit) -> Path:
    folder = tmp_path / "saved"
    shutil.copytree(saved, folder)
    file = folder / "tightfit-plan.json"
    file.write_text(edit(file.read_text()))
    return folder


def _rename_unit(text: str) -> str:
    plan = json.loads(text)
    unit = next(e for e in plan["entries"] if e["kind"] != "rest")
    unit["module"] = "model.layers.7"
    return json.dumps(plan)


def _duplicate_unit(text: str) -> str:
    plan = json.loads(text)
    plan["entries"].append(next(e for e in plan["entries"] if e["kind"] != "rest"))
    return json.dumps(plan)


@pytest.mark.parametrize(
    "edit, message",
    [
        (_rename_unit, "names module 'model.layers.7'"),
        (_duplicate_unit, "decides for module"),
        (lambda text: '{"entries":' * 100_000 + "1" + "}" * 100_000, "is not JSON: nested too deeply"),
        (lambda text: "\ufeff" + text, "is not JSON: Unexpected UTF-8 BOM"),
    ],
)
def test_a_broken_saved_plan_is_refused_naming_the_plan_file(saved, tmp_path, edit, message):
    folder = _edit_plan(saved[0], tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(str(folder / "tightfit-plan.json"))) as refused:
        tightfit.load(folder)
    assert message in str(refused.value)


def test_a_plan_given_naming_a_module_the_model_lacks_is_refused(tiny_llama):
    model, plan = plan_folder(tiny_llama, 40_000_000, example_inputs={"input_ids": IDS}, calibration=figures())
    unit = next(e for e in plan.entries if e.kind != "rest")
    wrong = replace(plan, entries=tuple(replace(e, module="model.layers.9") if e is unit else e for e in plan.entries))
    with pytest.raises(ValueError, match=r"the plan given names module 'model.layers.9'"):
        tightfit.load(tiny_llama, plan=wrong, model=model)


# -- the real command -------------------------------------------------------------------------


def _command() -> list[str]:
    script = Path(sys.executable).with_name("tightfit")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "tightfit.app.cli"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*_command(), *args], capture_output=True, text=True, timeout=600)


def _error_line(done: subprocess.CompletedProcess, command: str) -> str:
    # 'tightfit fit DIR' may print a deprecation note before the error
    lines = [line for line in done.stderr.splitlines() if not line.startswith(f"tightfit {command}: note:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"tightfit {command}: error: "), done.stderr
    return lines[0]


CLI_CONFIGS = [
    ({"architectures": 5}, "architectures=5"),
    ({"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None}, "num_attention_heads=3"),
    ({"hidden_size": "32"}, "hidden_size='32'"),
    ({"hidden_act": "nonesuch"}, "hidden_act='nonesuch'"),
    ({"rope_parameters": {"rope_type": "nonesuch", "rope_theta": 1e4}}, "rope_type='nonesuch'"),
    ({"pad_token_id": 10**6}, "pad_token_id=1000000"),
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"quantization_config": [1]}, "quantization_config=[1]"),
    ({"_attn_implementation": "nonesuch"}, "transformers"),
    (DEEP, "nested too deeply"),
]


def _commands(folder: Path) -> dict[str, list[str]]:
    return {
        "run": ["run", "--model", str(folder), *RUN],
        "fit": ["fit", "--model", str(folder), "--budget", "40MB"],
        "plan": ["plan", "--model", str(folder), "--batch", "1", "--seq", "4"],
    }


@pytest.mark.parametrize(("changes", "message"), CLI_CONFIGS, ids=[m.split("=")[0] for _, m in CLI_CONFIGS])
def test_every_command_refuses_a_broken_config_in_one_line(tiny_llama, tmp_path, capsys, changes, message):
    """The commands' own entry point, in this process: every config, every command."""
    folder = _with(tiny_llama, tmp_path, changes)
    for command, args in _commands(folder).items():
        assert cli.main(args) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and "Traceback" not in err
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"tightfit {command}: error: "), err
        assert f"{folder / 'config.json'}" in lines[0] and message in lines[0], (args, lines[0])


def test_the_real_commands_refuse_a_broken_config_in_one_line(tiny_llama, tmp_path):
    """The installed command, each in a new process: one broken config per command."""
    runs = []
    for command, number in (("run", 1), ("fit", 3), ("plan", len(CLI_CONFIGS) - 1)):
        changes, message = CLI_CONFIGS[number]
        folder = _with(tiny_llama, tmp_path / str(number), changes)
        runs.append((command, _commands(folder)[command], folder, message))
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = list(pool.map(lambda run: _run(run[1]), runs))
    for (command, args, folder, message), result in zip(runs, done):
        line = _error_line(result, command)
        assert f"{folder / 'config.json'}" in line and message in line, (args, line)
        assert result.stdout == "", (args, result.stdout)


def test_the_real_command_refuses_a_broken_checkpoint_in_one_line(tiny_llama, tmp_path):
    """With a budget, tightfit run streams the checkpoint through its own reader."""
    duplicate = tmp_path / "duplicate"
    shutil.copytree(tiny_llama, duplicate)
    shard = duplicate / "model.safetensors"
    data = shard.read_bytes()
    (length,) = __import__("struct").unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(key for key in header if key != "__metadata__")
    text = json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}}}"
    text += " " * (-len(text) % 8)
    shard.write_bytes(__import__("struct").pack("<Q", len(text)) + text.encode() + data[8 + length :])
    deep = tmp_path / "deep"
    shutil.copytree(tiny_llama, deep)
    (deep / "model.safetensors").rename(deep / "model-00001-of-00001.safetensors")
    (deep / "model.safetensors.index.json").write_text('{"weight_map":' * 100_000 + "{}" + "}" * 100_000)
    cases = [(duplicate, f"names {name!r} twice"), (deep, "model.safetensors.index.json is not valid JSON")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda case: _run(["run", "--model", str(case[0]), "--budget", "40MB", *RUN]), cases))
    for (_, message), result in zip(cases, done):
        assert message in _error_line(result, "run")


# -- under python -O: no check is an assert ----------------------------------------------------

_OPTIMIZED = """
import json, os, shutil, struct, sys, tempfile, time
from pathlib import Path
import tightfit
from tightfit.loading import Checkpoint, skeleton

source = Path(sys.argv[1])
results = {}

def expect(name, call, fragment):
    try:
        call()
    except ValueError as error:
        results[name] = fragment in str(error)
    else:
        results[name] = False

for name, changes, fragment in [
    ("heads", {"num_attention_heads": 0}, "num_attention_heads=0"),
    ("act", {"hidden_act": "nonesuch"}, "hidden_act='nonesuch'"),
    ("pad", {"pad_token_id": 10**6}, "pad_token_id=1000000"),
    ("architectures", {"architectures": 5}, "architectures=5"),
    ("quantization", {"quantization_config": [1]}, "quantization_config=[1]"),
]:
    folder = Path(tempfile.mkdtemp()) / "m"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    expect(name, lambda: skeleton(folder), fragment)

folder = Path(tempfile.mkdtemp())
header = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}'
(folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"abcd")
expect("duplicate", lambda: Checkpoint(folder), "names 'a' twice")
header = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
(folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"abX")
expect("trailing", lambda: Checkpoint(folder), "which no entry covers")
(folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"ab")
checkpoint = Checkpoint(folder)
old = os.stat(folder / "model.safetensors")
(folder / "new").write_bytes(struct.pack("<Q", len(header)) + header + b"cd")
os.utime(folder / "new", ns=(old.st_atime_ns, old.st_mtime_ns))
os.replace(folder / "new", folder / "model.safetensors")
expect("replaced", lambda: checkpoint.read("a"), "changed on disk")
print(json.dumps(results))
"""


def test_every_check_holds_under_python_O(tiny_llama):
    done = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMIZED, str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == dict.fromkeys(results, True) and len(results) == 8, results
