"""One rank of a stage run, as a test starts it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set): plans on rank 0, runs its stage, and rank 0 saves the run's result
and reports to ``OUT``. ``--die-at-send N``: this rank exits abruptly at its N-th send, as
a crashed process does; ``--hang-at-send N``: it stops answering there, as a stuck one
does (the tests of what the other ranks then do)."""

from __future__ import annotations

import argparse
import os
import time

import torch

from tightfit.distributed import link, plan_stages, process_group, ranks_from_environment, run_stage, shared_plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("out")
    parser.add_argument("--budgets", nargs="+", required=True)
    parser.add_argument("--inputs", required=True, help="a file holding the first stage's inputs (torch.save)")
    parser.add_argument("--max-new-tokens", type=int, default=0)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--die-at-send", type=int, default=0)
    parser.add_argument("--hang-at-send", type=int, default=0)
    args = parser.parse_args()
    ranks = ranks_from_environment()
    fault_at = args.die_at_send or args.hang_at_send
    if fault_at:
        sends = iter(range(fault_at, 0, -1))
        original = link.Link.send

        def send(self, *a, **k):
            if next(sends, 0) == 1:
                if args.die_at_send:
                    os._exit(9)
                time.sleep(3600)
            return original(self, *a, **k)

        link.Link.send = send
    inputs = torch.load(args.inputs)
    with process_group(ranks, args.timeout):
        plan = shared_plan(
            lambda: plan_stages(
                args.folder, args.budgets, inputs, max_new_tokens=args.max_new_tokens, micro_batches=args.micro_batches
            ),
            ranks,
        )
        run = run_stage(
            args.folder, plan, inputs, ranks, max_new_tokens=args.max_new_tokens, repeat=1, timeout_seconds=args.timeout
        )
    if run is not None:
        torch.save({"run": run.to_dict(), "embeddings": run.embeddings}, args.out)


if __name__ == "__main__":
    main()
