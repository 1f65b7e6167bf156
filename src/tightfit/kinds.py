"""Kinds of model: what tightfit recognizes a folder as, builds it with, plans it for and
runs it as. Each kind is one entry of one registry, so that a new kind (a classifier, an
encoder-decoder) is added in one place rather than as a branch in every module that
plans, loads, runs or reports a model.

An entry names transformers' auto class that builds the model, whether a config is of the
kind, the inputs a folder is planned for when none are given, and the job that
``tightfit run`` carries out (:class:`tightfit.app.jobs.Job`; a ``"module:attribute"``
string is imported only when a run needs it, so that planning and loading never import
the application). Kinds are tried newest first: one registered later (yours) wins over
the built-in ones, and the encoder, registered first, takes what no other kind claims.

Example (a sentence classifier)::

    register_kind(ModelKind(
        name="classifier",
        auto_class="AutoModelForSequenceClassification",
        matches=lambda config: any("ForSequenceClassification" in a for a in config.architectures or ()),
        batch=8,
        job=MyClassifierJob,
    ))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tightfit._validate import check_count, check_type

__all__ = [
    "CAUSAL_LM",
    "ENCODER",
    "ENCODER_DECODER",
    "ModelKind",
    "get_kind",
    "kind_names",
    "kind_of",
    "register_kind",
    "unregister_kind",
]

ENCODER = "encoder"
CAUSAL_LM = "causal-lm"
ENCODER_DECODER = "encoder-decoder"


@dataclass(frozen=True)
class ModelKind:
    """One kind of model. ``matches(config)``: whether a transformers config is of this
    kind. ``batch``: sequences of the inputs a folder is planned for when none are given
    (of up to 128 tokens each); ``attention_mask``: whether those inputs carry one.
    ``decoder_inputs``: whether a planned forward also takes ``decoder_input_ids`` (one
    start token per sequence: an encoder-decoder's first decoder step).
    ``job``: the class ``tightfit run`` builds for a folder of this kind, or where to
    import it from (``"package.module:Class"``). ``run_options``: the run options that
    apply to this kind only (refused for the others unless left at their defaults).
    ``noun`` and ``does`` name the kind in messages ("an encoder, which embeds
    sentences"); ``label``: how a run's header names it after the model ("" says nothing)."""

    name: str
    auto_class: str
    matches: Callable[[Any], bool]
    batch: int
    job: str | type
    attention_mask: bool = True
    decoder_inputs: bool = False
    run_options: tuple[str, ...] = field(default=())
    noun: str = "model"
    does: str = "runs"
    label: str = ""

    def __post_init__(self) -> None:
        check_type("name", self.name, str)
        check_type("auto_class", self.auto_class, str)
        if not self.name or not self.auto_class:
            raise ValueError(f"name and auto_class must be non-empty, got {self.name!r} and {self.auto_class!r}")
        if not callable(self.matches):
            raise TypeError(f"matches must be callable, got {type(self.matches).__name__}: {self.matches!r}")
        check_count("batch", self.batch, least=1)
        if not (isinstance(self.job, type) or (isinstance(self.job, str) and ":" in self.job)):
            raise TypeError(f"job must be a class or a 'module:Class' string, got {self.job!r}")
        check_type("run_options", self.run_options, tuple)

    @property
    def described(self) -> str:
        """The kind in a sentence: "an encoder, which embeds sentences"."""
        article = "an" if self.noun[:1].lower() in "aeiou" else "a"
        return f"{article} {self.noun}, which {self.does}"

    def job_class(self) -> type:
        """The job's class, imported where it was named by a string."""
        if isinstance(self.job, type):
            return self.job
        module, _, name = self.job.partition(":")
        return getattr(importlib.import_module(module), name)


_KINDS: dict[str, ModelKind] = {}


def register_kind(kind: ModelKind, *, replace: bool = False) -> ModelKind:
    """Add ``kind`` to the registry (tried before every kind registered earlier); a name
    already there is an error unless ``replace``. Returns ``kind``."""
    check_type("kind", kind, ModelKind)
    if kind.name in _KINDS and not replace:
        raise ValueError(f"a model kind named {kind.name!r} is registered already; pass replace=True to replace it")
    _KINDS.pop(kind.name, None)
    _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove the kind named ``name`` (a KeyError naming the registered ones if absent)."""
    if name not in _KINDS:
        raise KeyError(f"no model kind named {name!r}; registered: {', '.join(_KINDS)}")
    del _KINDS[name]


def kind_names() -> tuple[str, ...]:
    """The registered kinds' names, oldest first."""
    return tuple(_KINDS)


def get_kind(name: str) -> ModelKind:
    """The kind named ``name``; a ValueError naming the accepted ones otherwise."""
    kind = _KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"kind={name!r} is not accepted; accepted: {', '.join(_KINDS)}")
    return kind


def kind_of(config: Any) -> ModelKind:
    """The kind of a transformers config: the newest registered kind that claims it."""
    for kind in reversed(_KINDS.values()):
        if kind.matches(config):
            return kind
    model_type = getattr(config, "model_type", None) or type(config).__name__
    what = "an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "a model"
    raise ValueError(
        f"the model is {what} ({model_type}) of no kind tightfit knows; known kinds: {', '.join(_KINDS)} "
        f"(tightfit.kinds.register_kind adds one)"
    )


def _architectures(config: Any) -> set[str]:
    """The model classes a config names (``architectures``; one name, not a list, is read
    as transformers reads it)."""
    architectures = getattr(config, "architectures", None) or ()
    return {architectures} if isinstance(architectures, str) else set(architectures)


def _is_encoder_decoder(config: Any) -> bool:
    """A sequence-to-sequence LM (T5, BART): an encoder-decoder of transformers'
    ``AutoModelForSeq2SeqLM`` mapping, by its ``architectures`` or its model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as SEQ2SEQ

    if not getattr(config, "is_encoder_decoder", False):
        return False
    architectures = _architectures(config)
    if architectures:
        return not architectures.isdisjoint(SEQ2SEQ.values())
    return getattr(config, "model_type", None) in SEQ2SEQ


def _is_encoder(config: Any) -> bool:
    """Anything no other kind claims, but an encoder-decoder (T5, BART): its encoder alone
    would mislead."""
    return not getattr(config, "is_encoder_decoder", False)


def _is_causal_lm(config: Any) -> bool:
    """The config's ``architectures`` decide when present (a class of transformers'
    ``AutoModelForCausalLM`` mapping, such as ``LlamaForCausalLM``); without them
    ``is_decoder``, or a model type that has a causal LM and no masked LM (decoder-only
    families such as Llama and GPT-2; BERT has both and stays an encoder)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if getattr(config, "is_encoder_decoder", False):
        return False
    architectures = _architectures(config)
    if architectures:
        return not architectures.isdisjoint(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if getattr(config, "is_decoder", False):
        return True
    model_type = getattr(config, "model_type", None)
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


register_kind(
    ModelKind(
        name=ENCODER,
        auto_class="AutoModel",
        matches=_is_encoder,
        batch=8,
        job="tightfit.app.encoder_job:EncoderJob",
        run_options=("sentences", "top_pairs"),
        noun="encoder",
        does="embeds sentences",
    )
)
register_kind(
    ModelKind(
        name=CAUSAL_LM,
        auto_class="AutoModelForCausalLM",
        matches=_is_causal_lm,
        batch=1,
        job="tightfit.app.causal_lm_job:CausalLMJob",
        attention_mask=False,
        run_options=("prompt", "max_new_tokens", "context", "kv_cache", "graph"),
        noun="causal LM",
        does="generates text",
        label="causal LM",
    )
)
register_kind(
    ModelKind(
        name=ENCODER_DECODER,
        auto_class="AutoModelForSeq2SeqLM",
        matches=_is_encoder_decoder,
        batch=1,
        job="tightfit.app.seq2seq_job:Seq2SeqJob",
        decoder_inputs=True,
        run_options=("prompt", "max_new_tokens"),
        noun="encoder-decoder",
        does="generates text from text",
        label="encoder-decoder",
    )
)
