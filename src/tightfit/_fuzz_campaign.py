"""Runs hostile-input campaigns in worker processes, so a crash or a hang is blamed on the
case that caused it and the campaign goes on. Private; the targets are ``tightfit.ops.fuzz``
(raw ops) and ``tightfit.quant.fuzz`` (checkpoints).

A target is a module with ``make_case(seed, index)`` (the same case every time, in any
process, with ``op`` and ``label`` attributes) and ``run_case(case, index)`` returning
``(outcome, detail)``, the outcome one of :data:`OUTCOMES` but ``hang`` and ``crash``,
which only the parent can see.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["OUTCOMES", "CampaignResult", "main", "run_campaign"]

#: equal: a valid case matched the reference; clean: a hostile case raised a clean error;
#: refused: a valid case raised; unclean: another exception type; wrong: a hostile case
#: returned, a valid one differed, or data was changed that must not be.
OUTCOMES = ("equal", "clean", "refused", "unclean", "wrong", "hang", "crash")


def _worker(target: str, seed: int, start: int, stop: int) -> None:
    """Run cases start..stop-1, announcing each before it runs, so the parent can blame a crash."""
    import warnings

    import tightfit  # noqa: F401  (registers the ops and their kernels)

    module = importlib.import_module(target)
    warnings.simplefilter("ignore")
    # "crash:N,hang:M" makes cases N and M crash and stall: how the harness proves it catches both
    selftest = set(os.environ.get("TIGHTFIT_FUZZ_SELFTEST", "").split(","))
    for index in range(start, stop):
        print(f"start {index}", flush=True)
        if f"crash:{index}" in selftest:
            os.kill(os.getpid(), signal.SIGSEGV)
        if f"hang:{index}" in selftest:
            time.sleep(3600)
        case = module.make_case(seed, index)
        outcome, detail = module.run_case(case, index)
        print(f"done {index} {outcome} {case.op} | {case.label} | {detail}".replace("\n", " "), flush=True)


@dataclass
class CampaignResult:
    counts: Counter
    findings: list[str]
    seconds: float


def _lines(stream: Any) -> queue.Queue:
    """The worker's output lines, read by a thread (None at the end), so waits can time out."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _run_worker(
    target: str, seed: int, start: int, count: int, result: CampaignResult, case_timeout: float, first_timeout: float
) -> int:
    """Run cases from ``start`` in one worker until it finishes, crashes or hangs; the next index to run."""
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tightfit._fuzz_campaign", "--worker", target, str(seed), str(start), str(count)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        lines, in_flight, outcome = _lines(proc.stdout), None, None
        timeout = first_timeout  # the first case loads (or compiles) the kernels
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                proc.kill()
                outcome = "hang"
                break
            if line is None:
                outcome = "crash"
                break
            words = line.split(" ", 3)
            if words[0] == "start":
                in_flight = int(words[1])
                continue
            in_flight, start, timeout = None, int(words[1]) + 1, case_timeout
            result.counts[words[2]] += 1
            if words[2] not in ("equal", "clean"):
                result.findings.append(f"case {words[1]}: {words[2]} {words[3].rstrip()}")
        proc.wait()
        stderr.seek(0)
        last_words = stderr.read().decode(errors="replace").strip().splitlines()[-1:]
    if in_flight is None:
        if proc.returncode != 0 or start < count:
            raise RuntimeError(
                f"a fuzz worker failed outside any case (exit {proc.returncode}, {outcome}): {last_words}"
            )
        return start
    result.counts[outcome] += 1
    case = importlib.import_module(target).make_case(seed, in_flight)
    result.findings.append(
        f"case {in_flight}: {outcome} {case.op} | {case.label} (exit {proc.returncode}) {last_words}"
    )
    return in_flight + 1


def run_campaign(
    target: str, count: int, seed: int = 0, *, case_timeout: float = 20.0, first_timeout: float = 180.0
) -> CampaignResult:
    """Run ``count`` cases of ``target`` (a module name) in worker processes; a worker that
    crashes or hangs is replaced and the case is counted as such."""
    if not isinstance(target, str) or importlib.util.find_spec(target) is None:
        raise ValueError(f"target must name an importable module such as 'tightfit.ops.fuzz', got {target!r}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    result = CampaignResult(Counter(), [], 0.0)
    started = time.perf_counter()
    next_index = 0
    while next_index < count:
        next_index = _run_worker(target, seed, next_index, count, result, case_timeout, first_timeout)
    result.seconds = time.perf_counter() - started
    return result


def main(argv: list[str], target: str) -> int:
    """``python -m <target> [--count N] [--seed S]``: run a campaign, print its table and findings."""
    module = importlib.import_module(target)
    parser = argparse.ArgumentParser(prog=f"python -m {target}", description=(module.__doc__ or "").splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run_campaign(target, args.count, args.seed)
    print(f"{target}: {args.count} cases, seed {args.seed}, {result.seconds:.0f} s")
    print(" | ".join(["tried", *OUTCOMES]))
    print(" | ".join(str(n) for n in [sum(result.counts.values()), *(result.counts[o] for o in OUTCOMES)]))
    for finding in result.findings[:50]:
        print(finding)
    return 0 if not result.findings else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], *(int(a) for a in sys.argv[3:6]))
