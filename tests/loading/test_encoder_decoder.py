"""Encoder-decoders: a sequence-to-sequence LM (T5, BART) is a kind of its own; an
encoder-decoder of no registered kind is refused by name, not run as the encoder its
config also describes."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tightfit.app.run import RunOptions, plan_only  # noqa: E402
from tightfit.loading.folder import model_kind  # noqa: E402


@pytest.mark.parametrize("config", [transformers.T5Config(), transformers.BartConfig()], ids=["t5", "bart"])
def test_a_sequence_to_sequence_lm_is_an_encoder_decoder(config):
    assert model_kind(config) == "encoder-decoder"


def test_an_encoder_decoder_of_no_kind_is_refused_by_name(tmp_path):
    config = transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64)
    config.architectures = ["T5EncoderModel"]  # T5's encoder alone: no decoder to generate with
    with pytest.raises(
        ValueError, match=r"is an encoder-decoder \(t5\) of no kind.*encoder, causal-lm, encoder-decoder"
    ):
        model_kind(config)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"encoder-decoder \(t5\)"):
        plan_only(RunOptions(model=str(tmp_path), budget="1MB"))
