"""A local Hugging Face model folder as tightfit reads it before any weight: its config,
what kind of model it holds, its checkpoint's dtype, and the skeleton built from the
config with every parameter on the meta device. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tightfit._files import read_json
from tightfit.kinds import CAUSAL_LM, ENCODER, get_kind, kind_of
from tightfit.loading._config import check_built, check_config, config_errors

__all__ = [
    "CAUSAL_LM",
    "ENCODER",
    "check_builds",
    "checkpoint_dtype",
    "folder_kind",
    "model_folder",
    "model_kind",
    "skeleton",
]

#: dtypes a checkpoint's config may name (``torch_dtype``, or ``dtype`` from transformers 5).
_CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def require(module: str, extra: str = "hf") -> None:
    """RuntimeError naming the extra to install when the package ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        raise RuntimeError(
            f"this needs the Python package {module!r}; install it with: pip install 'tightfit[{extra}]'"
        )


def model_folder(path: str | Path) -> Path:
    """The folder, once its config.json is known to be a JSON object of a model type transformers knows."""
    if not isinstance(path, (str, Path)):
        raise TypeError(f"model must be a folder path, got {type(path).__name__}: {path!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model={str(path)!r} is not a folder; pass a local Hugging Face model folder")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model={str(path)!r} has no config.json; pass a local Hugging Face model folder")
    require("transformers")
    file = folder / "config.json"
    key, signature = str(file.resolve()), _signature(file)
    if _CHECKED.get(key) != signature:  # checked once per version of the file: a run asks many times
        _check_config(file)
        _CHECKED[key] = signature
    return folder


#: config.json files that passed :func:`_check_config`, by path: the file's signature then.
_CHECKED: dict[str, tuple[int, ...]] = {}
#: Configs :func:`read_config` built, by path: the file's signature then, and the config.
_CONFIGS: dict[str, tuple[tuple[int, ...], Any]] = {}


def _signature(file: Path) -> tuple[int, ...]:
    """What changes when a file is written or replaced: its inode, size and times (ns)."""
    stat = file.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def _check_config(file: Path) -> None:
    """Refuse, naming the file and the key, a config.json that transformers would fail on
    with a message naming neither (:func:`tightfit.loading._config.check_config`)."""
    config = read_json(file)
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object (a model config), got a JSON {type(config).__name__}")
    model_type = config.get("model_type")
    config_class = None
    if model_type is not None:  # else transformers may still tell the type from the folder's name, or says it cannot
        from transformers import __version__
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ValueError(
                f"{file}: model_type={model_type!r:.80} is not a model type that transformers {__version__} knows"
            )
        config_class = CONFIG_MAPPING[model_type]
    check_config(file, config, config_class)


def read_config(path: str | Path) -> Any:
    """The transformers config of a local folder (only config.json is read). A config that
    transformers cannot read is a ValueError naming config.json; ``architectures`` given
    as one name is read as a list of it, as transformers' auto classes read it. Read once
    per version of the file (its inode, size and times): a run asks for it several times."""
    folder = model_folder(path)
    from transformers import AutoConfig

    file = folder / "config.json"
    key, signature = str(file.resolve()), _signature(file)
    known = _CONFIGS.get(key)
    if known is not None and known[0] == signature:  # read once per version of the file; a copy each caller may change
        return copy.deepcopy(known[1])
    with config_errors(file, "read the model config"):
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if isinstance(getattr(config, "architectures", None), str):
        config.architectures = [config.architectures]
    check_built(file, config)
    _CONFIGS[key] = (signature, copy.deepcopy(config))
    return config


def model_kind(config: Any) -> str:
    """The name of the kind a transformers config is of (:func:`tightfit.kinds.kind_of`):
    ``"causal-lm"``, ``"encoder"``, or a kind registered since; a ValueError naming the
    model type where no kind claims it (an encoder-decoder)."""
    return kind_of(config).name


def folder_kind(path: str | Path) -> str:
    """:func:`model_kind` of a local Hugging Face folder (only its config.json is read)."""
    return model_kind(read_config(path))


def checkpoint_dtype(config: Any) -> torch.dtype:
    """The dtype the checkpoint's weights are in, as its config says (``dtype``, or
    ``torch_dtype`` before transformers 5); float32 where it says nothing."""
    # transformers 5 names it dtype and warns on every read of torch_dtype; before 4.56 only torch_dtype exists
    named = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if named is None:
        return torch.float32
    if isinstance(named, torch.dtype) and named in _CONFIG_DTYPES.values():
        return named
    if isinstance(named, str) and named in _CONFIG_DTYPES:
        return _CONFIG_DTYPES[named]
    raise ValueError(f"the config's dtype={named!r} is not accepted; accepted: {', '.join(_CONFIG_DTYPES)}")


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and their buffers
    for real: a buffer a checkpoint does not hold (rotary frequencies, position ids) is
    computed by its module's constructor, as when loading normally. A parameter's
    ``torch.empty`` is moved to meta before any initializer writes to it."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def check_builds(path: str | Path, kind: str) -> None:
    """Build the model of ``kind`` from a local folder's config.json on the meta device
    and drop it: a config transformers cannot build a model from is a ValueError naming
    config.json before any weight is read (what ``from_pretrained`` would raise as its
    own error, naming neither)."""
    config = read_config(path)
    auto_class = get_kind(kind).auto_class
    import transformers

    auto = getattr(transformers, auto_class)
    with config_errors(Path(path) / "config.json", f"build the model ({auto_class})"), _parameters_on_meta():
        auto.from_config(config)


def skeleton(path: str | Path, kind: str | None = None) -> tuple[nn.Module, Any]:
    """(model, config) of a local folder: the model of ``kind`` (default: the folder's own,
    :func:`model_kind`) built from its config in the checkpoint's dtype, in eval mode,
    parameters on the meta device (tied ones one object), buffers real. No weight is read."""
    config = read_config(path)
    auto_class = (kind_of(config) if kind is None else get_kind(kind)).auto_class
    import transformers

    file = Path(path) / "config.json"
    try:
        dtype = checkpoint_dtype(config)
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None
    auto = getattr(transformers, auto_class)
    with config_errors(file, f"build the model ({auto_class})"), _parameters_on_meta():
        model = auto.from_config(config, dtype=dtype)
    return model.eval(), config
