"""Kinds of model are entries of one registry (:mod:`tightfit.kinds`): a kind registered in
one place (here, a sentence classifier this test defines) is planned, loaded and run like
the built-in encoder and causal LM, and reported with its own table and quality figure."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from rich.table import Table

import tightfit
from tightfit.app.jobs import Job
from tightfit.app.models import default_model_dir, load_tokenizer
from tightfit.app.output import print_report
from tightfit.app.run import RunOptions, plan_only, run
from tightfit.kinds import ModelKind, get_kind, kind_names, kind_of, register_kind, unregister_kind
from tightfit.loading import plan_folder

transformers = pytest.importorskip("transformers")

SENTENCES = ("A man is eating food.", "The new movie is awesome.", "A cat sits on the mat.")


class ClassifierJob(Job):
    """Labels the sentences; quality is the share of labels full precision agrees with."""

    quality_metric = "label agreement vs full precision"
    quality_row = "label agreement, {changes} vs full"
    kind = "classifier"  # loaded by its registered auto class

    def __init__(self, folder, device, options, backend, skeleton=None) -> None:
        super().__init__(folder, device, options, backend, skeleton)  # the model (or skeleton) and tokenizer

    def example_inputs(self) -> dict[str, torch.Tensor]:
        return dict(self.tokenizer(list(SENTENCES), padding=True, return_tensors="pt").to(self.device))

    @torch.no_grad()
    def call(self) -> torch.Tensor:
        return self.model(**self.example_inputs()).logits.argmax(-1).cpu()

    def result(self) -> torch.Tensor:
        return self.call()

    def covers(self) -> str:
        return f"one forward over the {len(SENTENCES)} sentences"

    def fill(self, report, calls, reference) -> None:
        report.pairs = [(sentence, str(int(label)), 0.0) for sentence, label in zip(SENTENCES, calls[-1])]
        if reference is not None:
            report.quality = float((calls[-1] == reference).float().mean())

    @staticmethod
    def result_table(report) -> Table:
        table = Table(title="labels")
        table.add_column("sentence")
        table.add_column("label")
        for sentence, label, _ in report.pairs:
            table.add_row(sentence, label)
        return table

    @staticmethod
    def speed_rows(report, measured) -> list[tuple[str, str]]:
        return [("latency (median)", f"{measured.median_seconds * 1e3:.1f} ms")]


CLASSIFIER = ModelKind(
    name="classifier",
    auto_class="AutoModelForSequenceClassification",
    matches=lambda config: any(name.endswith("ForSequenceClassification") for name in config.architectures or ()),
    batch=4,
    job=ClassifierJob,
    noun="classifier",
    does="labels sentences",
    label="classifier",
)


@pytest.fixture(scope="module")
def classifier_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("classifier")
    tokenizer = load_tokenizer(default_model_dir())
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_labels=3,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def classifier_kind():
    register_kind(CLASSIFIER)
    try:
        yield CLASSIFIER
    finally:
        unregister_kind(CLASSIFIER.name)


def test_without_its_kind_a_classifier_folder_is_an_encoder(classifier_folder):
    assert kind_of(transformers.AutoConfig.from_pretrained(classifier_folder)).name == "encoder"


def test_a_registered_kind_is_planned_loaded_and_run(classifier_folder, classifier_kind):
    assert kind_names()[-1] == "classifier" and get_kind("classifier") is CLASSIFIER
    skeleton, plan = plan_folder(classifier_folder, "2MB")
    assert type(skeleton).__name__ == "BertForSequenceClassification"
    assert plan.predicted_peak_bytes <= 2_000_000 and not plan.applies_nothing
    model, loaded_plan = tightfit.load(classifier_folder, "2MB")
    assert type(model).__name__ == "BertForSequenceClassification" and loaded_plan.entries == plan.entries

    report = run(RunOptions(model=str(classifier_folder), budget="2MB", repeat=1))
    assert report.kind == "classifier" and report.quality_metric == "label agreement vs full precision"
    assert report.measured_peak_bytes <= 2_000_000 and 0.0 <= report.quality <= 1.0
    assert [sentence for sentence, _, _ in report.pairs] == list(SENTENCES)
    console = Console(file=io.StringIO(), width=160)
    print_report(report, console)
    shown = console.file.getvalue()
    assert "(classifier)" in shown and "labels" in shown and "label agreement, plan for" in shown


def test_options_of_another_kind_are_refused_naming_this_one(classifier_folder, classifier_kind):
    with pytest.raises(
        ValueError,
        match=r"max_new_tokens applies to causal LMs and encoder-decoders; model=.* is a classifier, which labels",
    ):
        plan_only(RunOptions(model=str(classifier_folder), budget="2MB", max_new_tokens=3))


def test_the_registry_refuses_a_second_kind_of_a_name_and_bad_entries():
    with pytest.raises(ValueError, match="a model kind named 'encoder' is registered already"):
        register_kind(get_kind("encoder"))
    with pytest.raises(ValueError, match=r"kind='seq2seq' is not accepted; accepted: encoder, causal-lm"):
        get_kind("seq2seq")
    with pytest.raises(KeyError, match="no model kind named 'seq2seq'"):
        unregister_kind("seq2seq")
    with pytest.raises(TypeError, match="job must be a class or a 'module:Class' string"):
        ModelKind(name="x", auto_class="AutoModel", matches=bool, batch=1, job="no colon")
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        ModelKind(name="x", auto_class="AutoModel", matches=bool, batch=0, job=ClassifierJob)
