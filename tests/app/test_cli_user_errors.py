"""Every user error of the ``tightfit`` command is one line on stderr naming the problem, exit 2, no traceback.

Broken model folders are made from a tiny causal LM by a seeded catalogue of damages
(garbled bytes, truncation points and header lengths drawn from the seed); most run
through ``cli.main`` in this process, a few through the real command in a subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import struct
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tightfit.app import cli, plan_command, run_command
from zoo.commands import side_by_side

RUN = ["--repeat", "1", "--max-new-tokens", "1"]


class _Payload:
    """Unpickling this runs a shell command: what torch.load(weights_only=True) must refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _json(folder: Path, value) -> None:
    (folder / "config.json").write_text(json.dumps(value))


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _garble_config(folder: Path, rng: random.Random) -> None:
    (folder / "config.json").write_bytes(bytes([rng.choice(b"{[x\x00\xff")]) + rng.randbytes(rng.randint(0, 64)))


def _non_object_config(folder: Path, rng: random.Random) -> None:
    _json(folder, rng.choice([[1, 2], "llama", 3.5, None, [{"model_type": "llama"}]]))


def _unknown_model_type(folder: Path, rng: random.Random) -> None:
    _json(folder, {**_config(folder), "model_type": rng.choice(["nonesuch", "", "llama2-typo", 7, ["llama"]])})


def _truncate_weights(folder: Path, rng: random.Random) -> None:
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: rng.randrange(0, len(data))])  # any cut leaves the header's promise unkept


def _garble_header(folder: Path, rng: random.Random) -> None:
    file = folder / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8] = rng.choice(b'x]0\x00\xff"')  # the header's opening brace: the JSON cannot parse
    for _ in range(rng.randint(0, 8)):
        data[rng.randrange(9, 8 + struct.unpack("<Q", data[:8])[0])] = rng.randrange(256)
    file.write_bytes(bytes(data))


def _bad_header_length(folder: Path, rng: random.Random) -> None:
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(struct.pack("<Q", rng.randrange(len(data), 1 << 64)) + data[8:])


def _no_weights(folder: Path, rng: random.Random) -> None:
    (folder / "model.safetensors").unlink()


def _empty_weights(folder: Path, rng: random.Random) -> None:
    (folder / "model.safetensors").write_bytes(b"")


def _missing_shard(folder: Path, rng: random.Random) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    shards = {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))


def _malicious_pickle(folder: Path, rng: random.Random) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"lm_head.weight": _Payload(folder / "PWNED")}, folder / "pytorch_model.bin")


def _empty_pickle(folder: Path, rng: random.Random) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")


def _no_tokenizer(folder: Path, rng: random.Random) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()


#: (damage, what the message must hold, whether ``tightfit plan`` (config only) sees it too)
DAMAGES = [
    (lambda folder, rng: (folder / "config.json").unlink(), "has no config.json", True),
    (lambda folder, rng: (folder / "config.json").write_bytes(b""), "config.json is not valid JSON", True),
    (_garble_config, "config.json is not valid JSON", True),
    (_non_object_config, "config.json must hold a JSON object", True),
    (_unknown_model_type, "is not a model type that transformers", True),
    (_no_weights, "has no weights: none of model.safetensors", False),
    (_empty_weights, "model.safetensors is empty", False),
    (_truncate_weights, "model.safetensors", False),
    (_garble_header, "model.safetensors is not a valid safetensors file", False),
    (_bad_header_length, "model.safetensors is not a valid safetensors file", False),
    (_missing_shard, "model-00002-of-00002.safetensors is missing", False),
    (_malicious_pickle, "torch.load(weights_only=True) refuses its pickled weights", False),
    (_empty_pickle, "pytorch_model.bin is empty", False),
    (_no_tokenizer, "its tokenizer does not load", False),
]


def broken_copy(tiny_llama: Path, tmp_path: Path, index: int, seed: int = 0) -> Path:
    folder = tmp_path / f"broken-{index}"
    shutil.copytree(tiny_llama, folder)
    DAMAGES[index][0](folder, random.Random(seed * 1000 + index))
    return folder


def one_error_line(err: str, command: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tightfit {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("index", range(len(DAMAGES)))
def test_a_broken_model_folder_is_one_line_and_exit_2(tiny_llama, tmp_path, capsys, index, seed):
    folder = broken_copy(tiny_llama, tmp_path, index, seed)
    _, expected, config_only = DAMAGES[index]
    assert cli.main(["run", "--model", str(folder), *RUN]) == 2
    captured = capsys.readouterr()
    assert expected in one_error_line(captured.err, "run") and captured.out == ""
    assert cli.main(["plan", "--model", str(folder), "--batch", "1", "--seq", "4"]) == (2 if config_only else 0)
    if config_only:
        assert expected in one_error_line(capsys.readouterr().err, "plan")
    assert not (folder / "PWNED").exists()


#: The folders the real command is given: a garbled safetensors header, a malicious pickle.
REAL = (9, 11)


def _run_command(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tightfit.app.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def real_runs(tiny_llama, tmp_path_factory):
    """(the REAL folders, ``tightfit run`` in fresh processes started side by side): on each
    folder, by its index, and with an invalid TIGHTFIT_STRICT ("strict")."""
    folders = {index: broken_copy(tiny_llama, tmp_path_factory.mktemp("real"), index, seed=7) for index in REAL}
    with side_by_side(
        {
            **{index: partial(_run_command, "--model", str(folder), *RUN) for index, folder in folders.items()},
            "strict": partial(_run_command, "--model", "/nonexistent", TIGHTFIT_STRICT="ture"),
        }
    ) as runs:
        yield folders, runs


def test_the_real_command_prints_one_line(real_runs):
    """Two folders through the real command: no traceback reaches the terminal."""
    folders, runs = real_runs
    for index, folder in folders.items():
        done = runs[index].result()
        assert done.returncode == 2 and done.stdout == ""
        assert DAMAGES[index][1] in one_error_line(done.stderr, "run")
        assert not (folder / "PWNED").exists()


def test_an_invalid_tightfit_strict_is_refused_before_any_work(real_runs):
    done = real_runs[1]["strict"].result()
    assert done.returncode == 2 and done.stdout == ""
    line = one_error_line(done.stderr, "run")
    assert "TIGHTFIT_STRICT='ture' is not accepted; accepted: 0, 1, false, no, off, on, true, yes" in line


def test_an_invalid_tightfit_strict_is_refused_at_first_read(monkeypatch):
    from tightfit import is_strict

    monkeypatch.setenv("TIGHTFIT_STRICT", "ture")
    with pytest.raises(
        ValueError, match=r"^TIGHTFIT_STRICT='ture' is not accepted; accepted: 0, 1, false, no, off, on, true, yes$"
    ):
        is_strict()


def test_tightfit_strict_is_checked_by_every_command(monkeypatch, capsys):
    monkeypatch.setenv("TIGHTFIT_STRICT", "2")
    assert cli.main(["backends", "--json"]) == 2
    assert capsys.readouterr() == (
        "",
        "tightfit backends: error: TIGHTFIT_STRICT='2' is not accepted; "
        "accepted: 0, 1, false, no, off, on, true, yes\n",
    )
    monkeypatch.setenv("TIGHTFIT_STRICT", " Yes ")
    assert cli.main(["backends", "--json"]) == 0


def test_a_full_disk_while_offloading_is_one_line(tiny_llama, monkeypatch, capsys):
    import tightfit.app.run

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/tightfit-offload/unit-00003.safetensors")

    monkeypatch.setattr(tightfit.app.run, "apply_offloading", full_disk)
    assert cli.main(["run", "--model", str(tiny_llama), "--offload", "disk", *RUN]) == 2
    line = one_error_line(capsys.readouterr().err, "run")
    assert (
        line
        == "tightfit run: error: [Errno 28] No space left on device: '/tmp/tightfit-offload/unit-00003.safetensors'"
    )


def test_a_multi_line_message_is_joined_into_one(monkeypatch, capsys):
    def failing(args, console):
        raise ValueError("first line\n\n  second line\t end")

    monkeypatch.setattr(plan_command, "handle", failing)
    assert cli.main(["plan"]) == 2
    assert capsys.readouterr().err == "tightfit plan: error: first line second line end\n"


def test_traceback_shows_a_user_error_and_bugs_keep_theirs(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        cli.main(["run", "--model", str(tmp_path / "missing"), "--traceback"])

    def bug(args, console):
        raise KeyError("a bug in tightfit")

    monkeypatch.setattr(run_command, "handle", bug)
    with pytest.raises(KeyError, match="a bug in tightfit"):
        cli.main(["run"])
