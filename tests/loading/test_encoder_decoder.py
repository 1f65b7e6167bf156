"""An encoder-decoder (T5, BART) is of no kind tightfit registers yet: it is refused by
name, not run as the encoder its config also describes."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tightfit.app.run import RunOptions, plan_only  # noqa: E402
from tightfit.loading.folder import model_kind  # noqa: E402


@pytest.mark.parametrize("config", [transformers.T5Config(), transformers.BartConfig()], ids=["t5", "bart"])
def test_an_encoder_decoder_is_refused_by_name(config):
    with pytest.raises(
        ValueError, match=rf"is an encoder-decoder \({config.model_type}\) of no kind.*encoder, causal-lm"
    ):
        model_kind(config)


def test_run_and_fit_refuse_a_t5_folder(tmp_path):
    config = transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"encoder-decoder \(t5\)"):
        plan_only(RunOptions(model=str(tmp_path), budget="1MB"))
