"""``--graph``: decoding replayed from a captured CUDA graph where the run allows it. On the
CPU, ``auto`` decodes eagerly and ``on`` is refused with the reason; the replay itself is
checked on a GPU (tests/app/test_captured.py, the GPU check)."""

from __future__ import annotations

import pytest

from tightfit.app.run import RunOptions, run


def test_graph_on_where_the_run_cannot_is_refused_with_the_reason(tiny_llama):
    options = RunOptions(model=str(tiny_llama), repeat=1, max_new_tokens=3, graph="on")
    with pytest.raises(ValueError, match=r"graph='on': graph=True needs input_ids on a CUDA device.*cpu"):
        run(options)


def test_graph_off_decodes_eagerly(tiny_llama):
    report = run(RunOptions(model=str(tiny_llama), repeat=1, max_new_tokens=3, graph="off"))
    assert report.decode_graph is False and report.new_tokens == 3


@pytest.mark.parametrize("value", ["yes", "", True, None])
def test_graph_takes_auto_on_or_off(value):
    with pytest.raises(ValueError, match=r"graph=.* is not accepted; accepted: auto, off, on"):
        RunOptions(graph=value)


def test_graph_is_refused_for_an_encoder():
    with pytest.raises(ValueError, match="graph applies to causal LMs"):
        run(RunOptions(graph="off", repeat=1))
