"""Checks on a model folder's config.json (D7, D9): what tightfit reads from it, and what
makes transformers fail with an error that names neither the file nor the key (a
KeyError, a ZeroDivisionError, an AssertionError from torch), is refused first with a
ValueError naming the file, the key, the value and what is accepted. Whatever else
transformers raises while it reads the config or builds the model from it becomes a
ValueError naming the file (:func:`config_errors`), the original chained; an error
raised by tightfit's own code is left as it is. Private to ``tightfit.loading``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__: list[str] = []  # private helpers

#: Sizes a model is built from, under the names the model families use: a positive int
#: where given (null is left to transformers' default).
_POSITIVE = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "n_embd",
    "n_head",
    "n_inner",
    "n_positions",
    "d_model",
    "num_heads",
    "d_ff",
    "d_kv",
)
#: Counts of modules built one by one (layers, experts): an int from 0 to :data:`MAX_MODULES`
#: where given. A far larger count takes hours to build (three milliseconds a layer of even
#: the smallest model), no model has one, and 2**64 layers never finish.
_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "num_local_experts", "num_experts", "n_routed_experts")
MAX_MODULES = 4096
#: Keys naming an activation function (transformers' ``ACT2FN``).
_ACTIVATIONS = ("hidden_act", "activation_function")
_ROPE_KEYS = ("rope_scaling", "rope_parameters")
#: The packages whose errors, raised while a config is read or a model built, describe the config.
_THIRD_PARTY = ("transformers", "huggingface_hub", "torch", "safetensors", "tokenizers")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(file: Path, key: str, value: object, accepted: str) -> None:
    raise ValueError(f"{file}: {key}={value!r:.120} is not accepted; accepted: {accepted}")


def _check_sizes(file: Path, config: dict[str, Any]) -> None:
    for key in _POSITIVE:
        value = config.get(key)
        if value is not None and not (_is_int(value) and value > 0):
            _refuse(file, key, value, "an int > 0")
    for key in _COUNTS:
        value = config.get(key)
        if value is not None and not (_is_int(value) and 0 <= value <= MAX_MODULES):
            _refuse(file, key, value, f"an int from 0 to {MAX_MODULES}")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if hidden is not None and heads is not None and config.get("head_dim") is None and hidden % heads:
        _refuse(
            file,
            "num_attention_heads",
            heads,
            f"a divisor of hidden_size={hidden} (each head takes hidden_size / num_attention_heads), or a head_dim",
        )
    kv_heads = config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        _refuse(
            file, "num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads} (heads share a key/value)"
        )
    vocab, pad = config.get("vocab_size"), config.get("pad_token_id")
    if pad is not None and not (_is_int(pad) and (vocab is None or -vocab <= pad < vocab)):
        bounds = f"an int from {-vocab} to {vocab - 1} (vocab_size={vocab})" if vocab is not None else "an int"
        _refuse(file, "pad_token_id", pad, f"null or {bounds}")


def _check_rope(file: Path, config: dict[str, Any]) -> None:
    for key in _ROPE_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            _refuse(file, key, value, "null or a JSON object of RoPE parameters")
        nested = [item for item in value.values() if isinstance(item, dict)]
        for name, parameters in [(key, value)] if not nested else [(f"{key}.{k}", v) for k, v in value.items()]:
            if parameters is None:
                continue
            if not isinstance(parameters, dict):
                _refuse(file, name, parameters, "null or a JSON object of RoPE parameters")
            for field in ("rope_type", "type"):
                if field in parameters and not isinstance(parameters[field], str):
                    _refuse(file, f"{name}.{field}", parameters[field], "a string naming a RoPE type")
            for field in ("rope_theta", "factor"):
                number = parameters.get(field)
                if number is not None and not (_is_number(number) and number > 0):
                    _refuse(file, f"{name}.{field}", number, "a number > 0")
    theta = config.get("rope_theta")
    if theta is not None and not (_is_number(theta) and theta > 0):
        _refuse(file, "rope_theta", theta, "a number > 0")


def check_config(file: Path, config: dict[str, Any], config_class: type | None = None) -> None:
    """Refuse, naming ``file`` and the key, what tightfit reads from a config.json and
    values that make transformers fail without naming either. ``config_class``: the
    transformers config class of its ``model_type``, where known (for its RoPE types)."""
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, str)
        or (isinstance(architectures, list) and all(isinstance(name, str) for name in architectures))
    ):
        _refuse(file, "architectures", architectures, "a list of class names such as ['LlamaForCausalLM'], or one")
    if "quantization_config" in config and not isinstance(config["quantization_config"], dict):
        _refuse(
            file,
            "quantization_config",
            config["quantization_config"],
            "a JSON object such as {'quant_method': 'bitsandbytes', 'load_in_4bit': true}",
        )
    for key in ("dtype", "torch_dtype"):
        if config.get(key) is not None and not isinstance(config[key], str):
            _refuse(file, key, config[key], "a dtype name such as 'bfloat16'")
    _check_sizes(file, config)
    _check_rope(file, config)
    for key in _ROPE_KEYS if config_class is not None else ():
        _check_rope_types(file, config.get(key), key, config_class)
    from transformers.activations import ACT2FN

    for key in _ACTIVATIONS:
        value = config.get(key)
        if value is not None and (not isinstance(value, str) or value not in ACT2FN):
            _refuse(file, key, value, ", ".join(sorted(ACT2FN)))


def _rope_types(config_class: type) -> set[str]:
    """The RoPE types transformers builds for a model of ``config_class``: its RoPE
    functions', and those the config class validates."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    own = {name[len("_validate_") : -len("_rope_parameters")] for name in dir(config_class) if _is_rope_check(name)}
    return {"default", *ROPE_INIT_FUNCTIONS, *own}


def _check_rope_types(file: Path, parameters: object, key: str, config_class: type) -> None:
    if not isinstance(parameters, dict):
        return
    layers = [(f"{key}.{k}", v) for k, v in parameters.items() if isinstance(v, dict)] or [(key, parameters)]
    for name, values in layers:
        rope_type = values.get("rope_type", values.get("type", "default"))
        known = _rope_types(config_class)
        if rope_type not in known:
            field = "rope_type" if "rope_type" in values else "type"
            _refuse(file, f"{name}.{field}", rope_type, ", ".join(sorted(known)))


def check_built(file: Path, config: Any) -> None:
    """Refuse a RoPE type that neither transformers' RoPE functions nor this model's
    config class knows (transformers only warns, then fails building the model with a
    KeyError naming the type alone)."""
    _check_rope_types(file, getattr(config, "rope_parameters", None), "rope_parameters", type(config))


def _is_rope_check(name: str) -> bool:
    return name.startswith("_validate_") and name.endswith("_rope_parameters")


_TIGHTFIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package(filename: str) -> str | None:
    """The top-level package a source file belongs to: 'tightfit', a third-party name, or None."""
    path = os.path.abspath(filename)
    if path.startswith(_TIGHTFIT + os.sep):
        return "tightfit"
    parts = path.split(os.sep)
    return next((part for part in reversed(parts) if part in _THIRD_PARTY), None)


def raised_by_transformers(error: BaseException) -> bool:
    """Whether ``error`` was raised inside transformers (or a library it called) rather
    than by tightfit's own code: some frame below the last of tightfit's is transformers'
    or huggingface_hub's."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(_package(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    last_own = max((i for i, package in enumerate(frames) if package == "tightfit"), default=-1)
    return any(package in ("transformers", "huggingface_hub") for package in frames[last_own + 1 :])


@contextlib.contextmanager
def config_errors(file: Path, what: str) -> Iterator[None]:
    """Turn what transformers raises on a bad config while ``what`` (reading the config,
    building the model) into a ValueError naming ``file``, chained; an error of tightfit's
    own code, a MemoryError and a KeyboardInterrupt pass unchanged."""
    try:
        yield
    except MemoryError:
        raise
    except Exception as error:
        if not raised_by_transformers(error):
            raise
        from transformers import __version__

        detail = " ".join(str(error).split()) or "(no message)"
        raise ValueError(
            f"{file}: transformers {__version__} cannot {what} from it: {type(error).__name__}: {detail:.400}"
        ) from error
