"""A run resolves its backend once, and asks for a folder's config several times:
config.json is checked and read once per version of the file, and a file changed or
replaced since is checked and read again (a cache must never hide a broken or different
config)."""

from __future__ import annotations

import json
import os

import pytest

import tightfit.loading.folder as folder_module
from tightfit.app.models import save_causal_lm
from tightfit.loading.folder import model_folder, read_config
from zoo.lm import TINY_CAUSAL_LM

pytest.importorskip("transformers")


def test_config_json_is_read_once_per_version_and_again_when_it_changes(tmp_path, monkeypatch):
    folder = save_causal_lm(tmp_path / "lm", **TINY_CAUSAL_LM)
    checks = []
    real_check = folder_module._check_config
    monkeypatch.setattr(folder_module, "_check_config", lambda file: checks.append(file) or real_check(file))
    first = read_config(folder)
    first.num_hidden_layers = 99  # a caller's change stays its own
    for _ in range(3):
        model_folder(folder)
        assert read_config(folder).num_hidden_layers == 2
    assert len(checks) == 1
    file = folder / "config.json"
    data = json.loads(file.read_text())
    data["max_position_embeddings"] = 128
    file.write_text(json.dumps(data))
    os.utime(file, ns=(1, 1))  # even with its times set back, the change of size and ctime shows
    assert read_config(folder).max_position_embeddings == 128 and len(checks) == 2
    file.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        model_folder(folder)


def test_a_budgeted_run_reads_its_config_json_once(tmp_path, monkeypatch):
    """tightfit's own reads of config.json over a whole budgeted run: one (transformers'
    tokenizer and config loaders read it too, on their own)."""
    import tightfit._files as files_module
    from tightfit.app.run import RunOptions, run

    folder = save_causal_lm(tmp_path / "lm", **TINY_CAUSAL_LM)
    reads = []
    real_read = files_module._read_capped
    monkeypatch.setattr(
        files_module, "_read_capped", lambda file, limit: reads.append(str(file)) or real_read(file, limit)
    )
    run(RunOptions(model=str(folder), budget="30MB", repeat=1, max_new_tokens=2, reference=False))
    assert [file for file in reads if file.endswith("config.json")] == [str(folder / "config.json")]


def test_a_budgeted_run_resolves_its_backend_once(tmp_path, monkeypatch):
    """The run resolves its backend and device once (``_setup``) and passes them down: the
    planner, the memory plan it traces with, and the load that streams the checkpoint into
    the plan resolve nothing again."""
    import tightfit.backends.resolve as resolve_module
    from tightfit.app.run import RunOptions, run

    folder = save_causal_lm(tmp_path / "lm", **TINY_CAUSAL_LM)
    again = []
    real_resolve = resolve_module._resolve
    monkeypatch.setattr(resolve_module, "_resolve", lambda backend: again.append(backend) or real_resolve(backend))
    report = run(RunOptions(model=str(folder), budget="30MB", repeat=1, max_new_tokens=2, reference=False))
    assert report.device == "cpu" and again == []
