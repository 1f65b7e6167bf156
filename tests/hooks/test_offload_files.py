"""Disk offloading against the outside world: a file written to or truncated by another
process is detected and nothing bad reaches the model; a failed write (a full disk)
offloads nothing; a killed process leaves nothing on disk."""

from __future__ import annotations

import errno
import gc
import json
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tightfit.hooks import OFFLOADING, HookRegistry, OffloadFileError, apply_offloading, remove_offloading
from tightfit.hooks._disk import MappedFile
from zoo.hooks import held_files, same_state, snapshot, stack

linux = pytest.mark.skipif(sys.platform != "linux", reason="uses /proc and RLIMIT_FSIZE")


def hook_of(module):
    return HookRegistry.get(module).hook(OFFLOADING)


def test_a_file_written_by_another_process_raises_and_nothing_is_written_back(tmp_path, monkeypatch):
    model = stack()
    x = torch.randn(2, 32)
    expected = model(x)
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    assert torch.equal(model(x), expected)
    fd = hook_of(model[1]).files[0]._file.fileno()
    os.pwrite(fd, os.urandom(256), 64)  # same size, other bytes
    with pytest.raises(
        OffloadFileError,
        match=r"offload file of unit '1' \(unnamed, in .*\) was written to after tightfit "
        r"wrote it: .* load the model's weights again",
    ):
        model(x)
    with pytest.raises(OffloadFileError, match="unit '1'"):
        remove_offloading(model)
    assert all(OFFLOADING in HookRegistry.get(block) for block in model)  # still offloaded: nothing copied back
    # were the change to escape the stat check, the CRC-32 still keeps it out of the model
    monkeypatch.setattr(MappedFile, "check", lambda self: None)
    with pytest.raises(
        OffloadFileError, match=r"unit '1' .* holds other bytes than written for tensor '\d' \(CRC-32 mismatch\)"
    ):
        remove_offloading(model)
    assert all(OFFLOADING in HookRegistry.get(block) for block in model)


def test_a_change_made_in_place_while_offloaded_is_kept(tmp_path):
    model, other = stack(), stack(seed=1)
    x = torch.randn(2, 32)
    apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    model.load_state_dict(other.state_dict())  # copies into the copy-on-write views, not into the files
    assert torch.equal(model(x), other(x))
    remove_offloading(model)
    assert same_state(model, snapshot(other))


def test_a_failed_write_offloads_nothing(tmp_path, monkeypatch):
    model = stack()
    saved, pointer = snapshot(model), model[0].up.weight.data_ptr()
    write, calls = MappedFile._write, []

    def full_disk(self, tensors):
        calls.append(self.unit)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, tensors)

    monkeypatch.setattr(MappedFile, "_write", full_disk)
    with pytest.raises(
        OSError,
        match=r"offloading failed \(No space left on device\) in .*; free space there or pass path= on "
        r"another disk. Nothing was offloaded: the module is as it was",
    ) as caught:
        apply_offloading(model, "cpu", offload_to="disk", path=tmp_path)
    assert caught.value.errno == errno.ENOSPC and calls == ["0", "1"]
    assert same_state(model, saved) and model[0].up.weight.data_ptr() == pointer
    assert all(HookRegistry.get(m) is None for m in model.modules())
    gc.collect()
    if sys.platform == "linux":
        assert held_files(os.getpid(), tmp_path) == set()  # the unit written before the failure is gone too


# -- another process: a real size limit, a truncated file, SIGKILL -------------------------------

CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    import torch
    from torch import nn
    from tightfit.hooks import OFFLOADING, HookRegistry, OffloadFileError, apply_offloading, remove_offloading

    folder, report = sys.argv[1], {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(64, 64), nn.Linear(8, 8))  # files of 288, 16640, 288 bytes
    x = torch.randn(2, 8)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, a write fails with EFBIG instead of killing us
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        apply_offloading(model, "cpu", offload_to="disk", path=folder)
    except OSError as error:
        report["limit"] = [error.errno, str(error), all(HookRegistry.get(m) is None for m in model.modules())]
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    apply_offloading(model, "cpu", offload_to="disk", path=folder)
    fd = HookRegistry.get(model[1]).hook(OFFLOADING).files[0]._file.fileno()
    os.truncate(f"/proc/{os.getpid()}/fd/{fd}", 100)  # what another process can do
    for step, call in [("forward", lambda: model(x)), ("remove", lambda: remove_offloading(model))]:
        try:
            call()
        except OffloadFileError as error:
            report[step] = str(error)
    report["still offloaded"] = OFFLOADING in HookRegistry.get(model[1])
    print(json.dumps(report), flush=True)
    sys.stdin.read()  # until killed
""")


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """A process that hits a file size limit, truncates one of its offload files, reports, and waits."""
    folder = tmp_path_factory.mktemp("offload")
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 300)
        line = process.stdout.readline() if ready else ""
        if not line:  # crashed (a SIGBUS shows as returncode -7) or hung
            process.kill()
            pytest.fail(f"the child process ended with {process.wait()}: {process.stderr.read()[-3000:]}")
        yield process, folder, json.loads(line)
    finally:
        process.kill()
        process.wait()


@linux
def test_a_real_write_failure_in_another_process_offloads_nothing(child):
    _, _, report = child
    number, message, untouched = report["limit"]
    assert number == errno.EFBIG and "Nothing was offloaded: the module is as it was" in message and untouched


@linux
def test_a_truncated_file_raises_cleanly_instead_of_sigbus(child):
    process, _, report = child
    assert process.poll() is None  # alive after touching the offloaded model
    assert "unit '1'" in report["forward"] and "was resized from 16640 to 100 bytes" in report["forward"]
    assert "was resized" in report["remove"] and report["still offloaded"]


@linux
def test_a_killed_process_leaves_nothing_on_disk(child):
    process, folder, _ = child
    assert len(held_files(process.pid, folder)) == 3 and list(folder.iterdir()) == []  # unnamed files, held open
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert list(folder.iterdir()) == []  # the OS freed them with the process: nothing to clean at the next start
