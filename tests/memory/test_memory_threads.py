"""allocated_peak and measure from several threads: no crash, sane figures, and fd 2 stays the process's stderr.

The threads run in a subprocess, so that a segfault fails the test instead of ending the run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tightfit.memory import allocated_peak, mark, measure

SCRIPT = r"""
import os, sys, threading, torch
from tightfit.memory import allocated_peak, measure

SIZE = 1 << 20  # float32 elements: 4 MiB
before = os.fstat(2)
figures, errors = [], []

def work(rounds):
    try:
        for _ in range(rounds):
            figures.append(("peak", allocated_peak(lambda: torch.empty(SIZE).fill_(1.0))))
            done = measure(lambda: torch.empty(SIZE).fill_(1.0), "cpu", repeat=1, warmup=0, baseline_bytes=7)
            figures.append(("measure", done.allocated_peak_bytes - 7))
            figures.append(("live", done.peak_bytes - 7))
    except BaseException as error:
        errors.append(repr(error))

for count in (2, 4):
    threads = [threading.Thread(target=work, args=(3,)) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
after = os.fstat(2)
assert not errors, errors
assert len(figures) == 3 * 3 * (2 + 4), len(figures)
wrong = [(kind, value) for kind, value in figures if value != 4 * SIZE]
assert not wrong, wrong  # each thread counts its own 4 MiB, never another thread's
assert (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino), "fd 2 no longer points to the original stderr"

try:
    allocated_peak(lambda: 1 / 0)
except ZeroDivisionError:
    pass
assert (os.fstat(2).st_dev, os.fstat(2).st_ino) == (before.st_dev, before.st_ino), "fd 2 not restored after fn raised"
os.write(2, b"fd 2 still reaches the parent\n")

os.close(2)  # a process without stderr: nothing to mute, and nothing fails
print("closed fd 2:", allocated_peak(lambda: torch.empty(SIZE).fill_(1.0)) == 4 * SIZE, flush=True)
"""


def test_threads_measure_safely_and_keep_stderr():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "fd 2 still reaches the parent" in done.stderr
    assert "profiler_start" not in done.stderr and "profiler_stop" not in done.stderr  # muted in every thread
    assert "closed fd 2: True" in done.stdout


def test_a_profiler_already_running_in_this_thread_is_refused():
    with pytest.raises(RuntimeError, match="a profiler is already running in this thread"):
        allocated_peak(lambda: allocated_peak(lambda: None))
    with torch.profiler.profile(), pytest.raises(RuntimeError, match="allocated_peak needs torch's profiler to itself"):
        allocated_peak(lambda: None)
    assert allocated_peak(lambda: torch.empty(256)) == 1024  # and the next call works


def test_marks_label_only_this_threads_timelines():
    import threading

    def other_thread():
        mark("elsewhere")

    def call():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        mark("here")
        torch.ones(1)

    done = measure(call, "cpu", repeat=1, warmup=0, timeline=True)
    assert [label for _, label in done.timeline.marks] == ["here"]
