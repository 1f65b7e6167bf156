"""The ``tightfit`` command: ``backends``, ``check``, ``run``, ``fit``, ``plan``, ``train`` and ``stages``.

Each command is one module of this package that holds its options and its handler
(``add_parser`` registers both); this module only builds the parser and turns errors into
exit statuses. A user error (a bad argument, a broken model folder, a full disk, a device
that cannot be used) is one line on stderr and exit status 2, as argparse reports a bad
flag; anything else is a bug and keeps its traceback. ``--traceback`` shows it for both.
Every message names options as the user types them (``--budget``, not ``budget``:
:mod:`tightfit.app.spelling`).

The console script starts in :mod:`tightfit_launcher`, which sets the OpenMP wait policy
before torch is loaded and then calls :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from tightfit._strict import is_strict
from tightfit.app import (
    backends_command,
    check_command,
    fit_command,
    plan_command,
    run_command,
    stages_command,
    train_command,
)
from tightfit.app.spelling import command_line, for_command_line

__all__ = ["main"]

#: What describes the user's input or machine rather than a bug in tightfit: D7's ValueError
#: and TypeError, RuntimeError for device state, OSError (unreadable files, a full disk),
#: MemoryError.
_USER_ERRORS = (ValueError, TypeError, RuntimeError, OSError, MemoryError)

#: The exit status of a command whose output pipe closed early, as a shell reports one killed by SIGPIPE.
_SIGPIPE_STATUS = 128 + 13

#: The commands in the order ``tightfit --help`` lists them.
_COMMANDS = (backends_command, check_command, run_command, fit_command, plan_command, train_command, stages_command)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tightfit", description="Run a model on any accelerator and make it fit in its memory."
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--traceback", action="store_true", help="on an error, print the full traceback instead of one line"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.add_parser(commands, parents=[common])
    for subparser in commands.choices.values():  # each command's keyword -> its flag, for its messages
        flags = {
            action.dest: max(action.option_strings, key=len)
            for action in subparser._actions
            if action.option_strings and action.dest != "help"
        }
        subparser.set_defaults(flags=flags)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tightfit`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        is_strict()  # an invalid TIGHTFIT_STRICT is refused now, not at the first fallback (or never)
        with command_line():
            return args.handler(args, console)
    except BrokenPipeError:  # the reader left (`tightfit plan --json | head`): stop quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return _SIGPIPE_STATUS
    except _USER_ERRORS as error:
        if args.traceback:
            raise
        message = " ".join(str(error).split()) or type(error).__name__  # one line, whatever the message holds
        message = for_command_line(message, args.flags)
        print(f"tightfit {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
