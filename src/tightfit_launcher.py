"""Start of the ``tightfit`` console script: the threading policy first, then the CLI.

OpenMP's threads spin while they wait for work by default, for about 3 ms (libgomp's
300,000 spins). On a machine where other processes want the cores (a shared or a busy
machine), the spinning threads and the others slow each other down: ``make run``'s
latency on a 2-core machine beside two busy loops measured 1.2-3.8 s, against 0.12-0.26 s
with ``OMP_WAIT_POLICY=PASSIVE``, which makes the waiting threads sleep at once. Sleeping
at once has its own cost where calls come close together, as a decoding step's per-layer
matmuls do (tens of microseconds apart): waking the sleeping thread took 15-20 µs per
call, a quarter of a small layer's call. So the waiting threads spin briefly first
(``GOMP_SPINCOUNT=3000``, about 30 µs by libgomp's estimate), then sleep: a 0.46B model's
nf4 decode measured 34.0/38.9/38.0 tok/s sleeping at once against 37.5/51.0/44.9 with
the brief spin (alternating runs), and ``make run`` beside two busy loops 92-96 ms
against 71-108 ms per forward.

The OpenMP runtime reads these once, when torch loads it, so they must be set before
``import torch``; and since ``import tightfit`` imports torch, this module lives outside
the package and imports nothing from it until they are set. Where the user set either
variable, neither is set: their policy is kept as they meant it.

Only the command gets these defaults: ``import tightfit`` in a user's program changes no
environment variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

__all__ = ["THREAD_DEFAULTS", "main", "thread_defaults"]

#: Set before torch loads unless the user set one of them.
THREAD_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}


def thread_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to set in ``environ``: all of :data:`THREAD_DEFAULTS`, or none where
    the user set any of them."""
    return {} if any(name in environ for name in THREAD_DEFAULTS) else dict(THREAD_DEFAULTS)


def main() -> None:
    """Console-script entry point: set the thread defaults, then exit with the CLI's status."""
    os.environ.update(thread_defaults(os.environ))
    # Imported only now, not at the top: importing tightfit loads torch and its OpenMP runtime.
    from tightfit.app.cli import main as cli_main

    sys.exit(cli_main())


if __name__ == "__main__":
    main()
