"""``tightfit run`` on a causal LM: a tiny Llama-style model built from a config and saved
offline (random weights, the default model's tokenizer), generated from greedily."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import partial

import pytest
import torch

from tightfit.app.generation import generate_greedy, token_agreement
from tightfit.app.models import CAUSAL_LM, ENCODER, folder_kind, load_causal_lm, model_kind, save_causal_lm
from tightfit.app.run import DEFAULT_PROMPT, RunOptions, run
from zoo.commands import side_by_side
from zoo.lm import TINY_CAUSAL_LM as TINY

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def report(tiny_llama):
    return run(RunOptions(model=str(tiny_llama), repeat=2, max_new_tokens=6))


def test_saved_folder_loads_offline_as_a_llama(tiny_llama):
    assert folder_kind(tiny_llama) == CAUSAL_LM
    model, tokenizer = load_causal_lm(tiny_llama, torch.device("cpu"))
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.config.vocab_size == len(tokenizer) == 30522
    # 2 x 30522 x 32 (embeddings, LM head) + 2 layers x (2 x 32 x 32 + 2 x 32 x 16 + 3 x 32 x 64) + 5 norms x 32
    assert sum(p.numel() for p in model.parameters()) == 2 * 30522 * 32 + 2 * (2048 + 1024 + 6144) + 5 * 32


def test_builder_is_seeded_and_leaves_the_global_random_state(tmp_path):
    state = torch.random.get_rng_state()
    first = save_causal_lm(tmp_path / "a", **TINY, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = save_causal_lm(tmp_path / "b", **TINY, seed=3)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hidden_size": 0}, ValueError, "hidden_size must be an int >= 1, got 0"),
        ({"num_hidden_layers": 1.5}, ValueError, "num_hidden_layers must be an int >= 1"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0"),
        ({"hidden_size": 30}, ValueError, "must be a multiple of num_attention_heads"),
        ({"dtype": torch.int8}, ValueError, "dtype=torch.int8 is not accepted; accepted: torch.float32"),
    ],
)
def test_builder_rejects_bad_sizes(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        save_causal_lm(tmp_path, **{**TINY, **kwargs})


def test_builder_stores_the_weights_in_the_dtype_asked(tmp_path):
    import json

    from safetensors import safe_open

    folder = save_causal_lm(tmp_path / "lm", **TINY, seed=3, dtype=torch.bfloat16)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(folder / "model.safetensors", "pt") as stored:
        assert {stored.get_tensor(name).dtype for name in stored.keys()} == {torch.bfloat16}
    full = save_causal_lm(tmp_path / "full", **TINY, seed=3)
    with safe_open(full / "model.safetensors", "pt") as a, safe_open(folder / "model.safetensors", "pt") as b:
        assert all(torch.equal(a.get_tensor(k).to(torch.bfloat16), b.get_tensor(k)) for k in a.keys())


def test_builder_rejects_a_file_as_folder(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        save_causal_lm(tmp_path / "file", **TINY)
    with pytest.raises(TypeError, match="path must be str or Path, got int"):
        save_causal_lm(3)


def test_model_kind_reads_the_config():
    from transformers import BertConfig, GPT2Config, LlamaConfig

    assert model_kind(LlamaConfig()) == CAUSAL_LM  # decoder-only family, no architectures
    assert model_kind(BertConfig()) == ENCODER  # BERT has a masked LM: an encoder
    assert model_kind(BertConfig(is_decoder=True)) == CAUSAL_LM
    assert model_kind(GPT2Config(architectures=["GPT2LMHeadModel"])) == CAUSAL_LM
    assert model_kind(GPT2Config(architectures=["GPT2Model"])) == ENCODER  # a base model: its hidden states
    assert model_kind(BertConfig(architectures=["BertModel"])) == ENCODER


def test_causal_lm_run_reports_text_speed_and_memory(report, tiny_llama):
    assert report.kind == CAUSAL_LM and report.model == str(tiny_llama) and report.backend == "cpu"
    assert report.prompt == DEFAULT_PROMPT and report.new_tokens == 6 and report.prompt_tokens > 5
    assert isinstance(report.generated_text, str)
    assert report.time_to_first_token_seconds > 0 and report.decode_tokens_per_second > 0
    assert report.decode_graph is False  # --graph auto: no CUDA device here
    assert len(report.measurement.seconds) == 2
    assert report.measurement.peak_bytes > report.weights_bytes
    # nothing changed: no quality figure, as for encoders; the encoder's fields stay empty
    assert (
        report.changes is None
        and report.token_agreement is None
        and report.quality is None
        and report.full_text is None
    )
    assert report.embedding_dim is None and report.pairs == [] and report.min_cosine_to_full is None


def test_token_agreement_is_one_for_the_model_itself(tiny_llama):
    model, tokenizer = load_causal_lm(tiny_llama, torch.device("cpu"))
    ids = tokenizer(DEFAULT_PROMPT, return_tensors="pt").input_ids
    generation = generate_greedy(model, ids, 8)
    assert len(generation.tokens) == 8 and generation.decode_tokens_per_second > 0
    # teacher forcing over the continuation agrees with the cached step-by-step decoding
    assert token_agreement(model, ids, generation.tokens) == 1.0
    assert generate_greedy(model, ids, 1).decode_tokens_per_second is None


def test_generation_rejects_bad_input(tiny_llama):
    model, _ = load_causal_lm(tiny_llama, torch.device("cpu"))
    ids = torch.tensor([[101, 2000]])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        generate_greedy(model, ids, 0)
    with pytest.raises(ValueError, match=r"input_ids must be a \(1, n >= 1\) int64 tensor, got shape \(2,\)"):
        generate_greedy(model, ids[0], 2)
    with pytest.raises(TypeError, match="input_ids must be Tensor, got list"):
        token_agreement(model, [[101]], (1,))
    with pytest.raises(ValueError, match="reference must be a non-empty tuple of token ids"):
        token_agreement(model, ids, ())
    with pytest.raises(TypeError, match="synchronize must be None or a callable taking no argument, got str: 'cuda'"):
        generate_greedy(model, ids, 2, synchronize="cuda")


def test_nf4_reports_token_agreement(tiny_llama):
    report = run(RunOptions(model=str(tiny_llama), repeat=1, max_new_tokens=8, quant="nf4"))
    assert report.kept_8bit == ("model.layers.1",) and report.kept_8bit_linears == 7
    assert report.full_text is not None and report.weights_bytes < report.full_weights_bytes
    assert 0.0 <= report.token_agreement <= 1.0 and report.quality == report.token_agreement
    assert report.quality_metric == "token agreement vs full precision"


def test_offloaded_to_disk_agrees_fully(tiny_llama):
    report = run(RunOptions(model=str(tiny_llama), repeat=1, max_new_tokens=4, offload="disk", prompt="The sea"))
    assert report.device_weights_bytes == 0 and report.prompt == "The sea"
    assert report.token_agreement == 1.0  # the same weights, only stored elsewhere


def test_cli_json_for_a_causal_lm(tiny_llama, capsys):
    from tightfit.app.cli import main

    assert (
        main(
            [
                "run",
                "--model",
                str(tiny_llama),
                "--repeat",
                "1",
                "--max-new-tokens",
                "3",
                "--prompt",
                "Hello there",
                "--storage-dtype",
                "bfloat16",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert captured.err == ""  # no progress bars where stderr is not a terminal
    assert data["kind"] == "causal-lm" and data["prompt"] == "Hello there" and data["new_tokens"] == 3
    assert data["time_to_first_token_ms"] > 0 and data["decode_tokens_per_second"] > 0
    assert data["quality"] == {"metric": "token agreement vs full precision", "value": data["token_agreement"]}
    assert 0.0 <= data["token_agreement"] <= 1.0 and data["storage_dtype"] == "bfloat16"
    assert data["embedding_dim"] is None and data["pairs"] == [] and data["timeline"] is None
    assert data["peak_bytes"] > data["weights_bytes"] > 0


def test_cli_table_for_a_causal_lm(tiny_llama, capsys):
    from tightfit.app.cli import main

    assert main(["run", "--model", str(tiny_llama), "--repeat", "1", "--max-new-tokens", "2", "--quant", "int8"]) == 0
    out = capsys.readouterr().out
    assert "(causal LM)" in out and "greedy generation" in out and "2 new tokens" in out and "full precision" in out
    assert "token agreement, int8 vs full" in out and "time to first token" in out and "decode speed (median)" in out


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prompt": ""}, ValueError, "prompt must be a non-empty string or None, got ''"),
        ({"prompt": "   "}, ValueError, "prompt must be a non-empty string"),
        ({"prompt": 5}, ValueError, "prompt must be a non-empty string or None, got 5"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1 or None, got 0"),
        ({"max_new_tokens": True}, ValueError, "max_new_tokens must be an int >= 1 or None, got True"),
        ({"max_new_tokens": "8"}, ValueError, "max_new_tokens must be an int >= 1 or None, got '8'"),
        ({"timeline": "memory.svg"}, ValueError, "timeline='memory.svg' must end in .png"),
        ({"timeline": "/nonexistent/memory.png"}, ValueError, "the folder '/nonexistent' does not exist"),
        ({"timeline": 7}, TypeError, "timeline must be str or Path, got int"),
    ],
)
def test_run_options_reject_bad_generation_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        RunOptions(**kwargs)


def test_run_rejects_generation_options_for_an_encoder_and_too_long_generations(tiny_llama):
    with pytest.raises(
        ValueError,
        match="^max_new_tokens applies to causal LMs and encoder-decoders; the built-in model is an encoder, which embeds",
    ):
        run(RunOptions(max_new_tokens=4))
    with pytest.raises(
        ValueError,
        match=r"^prompt \(\d+ tokens\) and max_new_tokens=60 make \d+ positions; the model takes at most 64 "
        r"\(max_position_embeddings in its config.json\)$",
    ):
        run(RunOptions(model=str(tiny_llama), max_new_tokens=60))


def test_cli_reports_bad_generation_flags(tiny_llama, tmp_path, capsys):
    from tightfit.app.cli import main

    for flags, message in [
        (["--max-new-tokens", "0"], "tightfit run: error: --max-new-tokens must be an int >= 1, got 0\n"),
        (["--prompt", ""], "tightfit run: error: --prompt must be a non-empty string, got ''\n"),
        (["--max-new-tokens", "60"], "--prompt (17 tokens) and --max-new-tokens=60 make 77 positions; the model takes"),
        (["--timeline", str(tmp_path / "no" / "t.png")], "does not exist"),
        (["--timeline", str(tmp_path / "t.jpg")], "must end in .png"),
    ]:
        assert main(["run", "--model", str(tiny_llama), *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--max-new-tokens", "many"])
    assert "invalid int value: 'many'" in capsys.readouterr().err


#: Under ``python -O``: every check of the generation options still raises.
OPTIMIZED = """
from tightfit.app.run import RunOptions
assert False, "asserts must be off under -O"
for kwargs, error in [({"prompt": ""}, ValueError), ({"max_new_tokens": 0}, ValueError), ({"timeline": "x.svg"}, ValueError),
                      ({"timeline": 3}, TypeError)]:
    try:
        RunOptions(**kwargs)
    except error:
        continue
    raise SystemExit(f"{kwargs} was accepted")
print("ok")
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def commands(tiny_llama):
    """The fresh processes the tests read, started side by side."""
    real = ["-W", "error::FutureWarning", "-m", "tightfit.app.cli", "run", "--model", str(tiny_llama)]
    with side_by_side(
        {
            "optimized": partial(_python, "-O", "-c", OPTIMIZED),
            "real": partial(_python, *real, "--repeat", "1", "--max-new-tokens", "3"),
        }
    ) as runs:
        yield runs


def test_bad_generation_input_is_rejected_under_python_O(commands):
    done = commands["optimized"].result()
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (tightfit[plot]) is not installed")
def test_timeline_png_of_a_causal_lm_run(tiny_llama, tmp_path):
    target = tmp_path / "memory.png"
    report = run(RunOptions(model=str(tiny_llama), repeat=1, max_new_tokens=3, timeline=target))
    assert report.timeline_path == str(target) and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timeline = report.measurement.timeline
    assert [label for _, label in timeline.marks] == ["prefill", "decode"]
    assert timeline.samples[0] == report.weights_bytes  # before the first op: the weights
    assert timeline.peak_bytes == report.measurement.peak_bytes  # one recorded call: the measured peak
    plotted = timeline.plot(
        tmp_path / "with-lines.png", budget_bytes=2 * report.weights_bytes, predicted_peak_bytes=timeline.peak_bytes
    )
    assert plotted.stat().st_size > 1000
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 0 or None, got -1"):
        timeline.plot(tmp_path / "bad.png", budget_bytes=-1)


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="matplotlib is installed")
def test_timeline_without_matplotlib_names_the_extra(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"tightfit run --timeline needs matplotlib; install it with: pip install 'tightfit\[plot\]'"
    ):
        RunOptions(timeline=tmp_path / "memory.png")


def test_progress_bars_for_loading_and_conversion(tiny_llama):
    import io

    from rich.console import Console

    from tightfit._progress import show_progress

    screen = io.StringIO()
    with show_progress(Console(file=screen, force_terminal=True, width=120)):
        run(RunOptions(model=str(tiny_llama), repeat=1, max_new_tokens=2, storage_dtype="float8_e4m3fn", offload="cpu"))
    drawn = screen.getvalue()
    assert "Loading weights" in drawn and "casting weights to float8_e4m3fn" in drawn and "offloading to cpu" in drawn
    assert "15/15" in drawn  # the 2 x 7 Linear weights and the LM head are cast; norms and embeddings stay


def test_generation_warns_nothing(tiny_llama):
    """transformers deprecates the legacy cache and, from 5.x, the past_key_values keyword: a
    user can act on neither, so generation passes a Cache object by the keyword the model takes."""
    import warnings

    model, tokenizer = load_causal_lm(tiny_llama, torch.device("cpu"))
    ids = tokenizer(DEFAULT_PROMPT, return_tensors="pt").input_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generated = generate_greedy(model, ids, 4)
    with torch.inference_mode():  # the same tokens as generating without a cache, one full forward a token
        tokens = ids
        for _ in range(4):
            tokens = torch.cat([tokens, model(input_ids=tokens, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert generated.tokens == tuple(tokens[0, ids.shape[1] :].tolist())


def test_the_cache_goes_by_the_keyword_the_model_takes():
    from transformers import Cache

    from tightfit.app.kv_cache import cache_argument

    class Older(torch.nn.Module):  # transformers before the rename
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            raise NotImplementedError

    class Newer(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            raise NotImplementedError

    (older_keyword, older_cache), (newer_keyword, newer_cache) = (
        next(iter(cache_argument(Older()).items())),
        next(iter(cache_argument(Newer()).items())),
    )
    assert (older_keyword, newer_keyword) == ("past_key_values", "cache")
    assert isinstance(older_cache, Cache) and isinstance(newer_cache, Cache) and older_cache is not newer_cache


def test_the_real_command_on_a_causal_lm_prints_no_future_warning(commands):
    done = commands["real"].result()
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "deprecated" not in done.stderr, done.stderr
    assert "greedy generation" in done.stdout
