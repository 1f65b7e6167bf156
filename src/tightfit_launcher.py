"""Start of the ``tightfit`` console script: the threading policy first, then the CLI.

OpenMP's threads spin while they wait for work by default. On a machine where other
processes want the cores (a shared or a busy machine), the spinning threads and the
others slow each other down: ``make run``'s latency on a 2-core machine beside two
busy loops measured 1.2-3.8 s, against 0.12-0.26 s with ``OMP_WAIT_POLICY=PASSIVE``,
which makes the waiting threads sleep instead. The OpenMP runtime reads it
once, when torch loads it, so it must be set before ``import torch``; and since
``import tightfit`` imports torch, this module lives outside the package and imports
nothing from it until the variable is set. A value the user set is kept.

Only the command gets this default: ``import tightfit`` in a user's program changes no
environment variable.
"""

from __future__ import annotations

import os
import sys

__all__ = ["main"]

#: Set before torch loads unless the user set it.
THREAD_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def main() -> None:
    """Console-script entry point: set the thread defaults, then exit with the CLI's status."""
    for name, value in THREAD_DEFAULTS.items():
        os.environ.setdefault(name, value)
    # Imported only now, not at the top: importing tightfit loads torch and its OpenMP runtime.
    from tightfit.app.cli import main as cli_main

    sys.exit(cli_main())


if __name__ == "__main__":
    main()
