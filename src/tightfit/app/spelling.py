"""How a message names an option (private).

The app is called two ways: from Python (``run(RunOptions(budget="40MB"))``), where an
option is a keyword (``budget``, ``max_new_tokens``), and by the ``tightfit`` command,
whose user types flags (``--budget``, ``--max-new-tokens``). A message must name the
option as its reader writes it, and suggest only what that reader can write.

- The app's own messages call :func:`option` (and :func:`assigned`), which spell the name
  for the caller: the ``tightfit`` command runs its handlers inside :func:`command_line`.
- Messages raised below the app (``budget='1.5XB' is not a size``, from
  :func:`tightfit.parse_size`) name an argument as ``name=value`` (D7);
  :func:`for_command_line` turns that into ``--flag=value`` for the command's own
  options, which a shell accepts as typed, and drops ``or None`` (on the command line,
  leaving the option out).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__: list[str] = []

_PLAIN = re.compile(r"[\w.,:/+-]+")  # a value a shell takes as it is, unquoted

_ON_COMMAND_LINE: ContextVar[bool] = ContextVar("tightfit_command_line", default=False)


def on_command_line() -> bool:
    """Whether the ``tightfit`` command is running the app now."""
    return _ON_COMMAND_LINE.get()


@contextmanager
def command_line() -> Iterator[None]:
    """Messages made inside name options as the command's flags."""
    token = _ON_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)


def option(name: str) -> str:
    """``name`` (a keyword of :class:`tightfit.app.run.RunOptions` or of a command) as the
    reader writes it: ``max_new_tokens`` from Python, ``--max-new-tokens`` on the command line."""
    return "--" + name.replace("_", "-") if on_command_line() else name


def assigned(name: str, value: Any) -> str:
    """``name`` given ``value`` as the reader writes it: ``budget='1.7MB'`` from Python,
    ``--budget=1.7MB`` on the command line."""
    if on_command_line():
        text = str(value)
        return f"{option(name)}={text if _PLAIN.fullmatch(text) else repr(text)}"
    return f"{name}={value!r}"


def for_command_line(message: str, flags: Mapping[str, str]) -> str:
    """``message`` as the command's user reads it: ``name=`` becomes ``--flag=`` for each
    of the command's options (``flags``: keyword to flag, e.g. ``"max_new_tokens":
    "--max-new-tokens"``), and ``or None`` is dropped. A name inside a longer word or
    already spelled as a flag is left alone."""
    for name, flag in flags.items():
        message = re.sub(rf"(?<![\w.-]){re.escape(name)}=", f"{flag}=", message)
    return message.replace(" or None", "")
