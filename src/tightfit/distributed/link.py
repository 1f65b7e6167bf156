"""Sending a stage's tensors to the next rank over ``torch.distributed`` point-to-point
calls, timed, with every failure of a peer turned into a :class:`StageError` that names it.

Tensors travel as their bytes through host memory (a small header first: dtype and
shape), so that any two ranks exchange them whatever devices they compute on and
whatever dtypes the process group's backend supports; gloo carries them between CPU
processes. A peer that dies closes its connections and the waiting rank fails at once; a
peer that stops answering fails the wait after the link's timeout (each call waits at most
that long; the process group's own timeout, longer, covers planning and loading).
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HEADER_BYTES", "Link", "StageError", "check_seconds", "collective"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8)
_MOST_DIMS = 6
#: The most bytes one message may announce: a header asking for more is not one a stage made.
_MOST_BYTES = 1 << 40
#: The header before each tensor: its dtype, its number of dims and its shape, as int64.
HEADER_BYTES = (2 + _MOST_DIMS) * 8


class StageError(RuntimeError):
    """A rank's stage could not go on: a peer died or did not answer in time. ``rank``:
    this rank; ``peer``: the rank it was waiting on or sending to (None where unknown)."""

    def __init__(self, message: str, *, rank: int, peer: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


def check_seconds(name: str, value: Any) -> float:
    """``value`` as seconds: a finite number > 0; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def collective(call: Callable[[], Any], rank: int, doing: str) -> None:
    """``call()``, a collective of every rank; where a peer failed meanwhile, a
    :class:`StageError` saying what this rank was ``doing``."""
    try:
        call()
    except (RuntimeError, dist.DistError) as error:
        raise StageError(
            f"rank {rank}: a peer failed while {doing}; the run ends on every rank ({error})", rank=rank, peer=None
        ) from None


class Link:
    """This rank's point-to-point calls, with the seconds spent in them and the bytes sent."""

    def __init__(self, rank: int, timeout_seconds: float) -> None:
        self.rank = rank
        self.timeout_seconds = timeout_seconds
        self.seconds = 0.0
        self.sent_bytes = 0

    def _failed(self, error: Exception, peer: int, doing: str) -> StageError:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        cause = (
            f"rank {peer} did not answer within {self.timeout_seconds:g} s"
            if "Timed out" in first or "timeout" in first.lower()
            else f"rank {peer} stopped (its connection closed)"
            if "closed" in first.lower() or "reset" in first.lower()
            else "the call failed"
        )
        return StageError(
            f"rank {self.rank}: {cause} while {doing}; the run ends on every rank ({first})", rank=self.rank, peer=peer
        )

    def _wait(self, work: Any) -> None:
        """Wait for one point-to-point call at most the link's timeout (the process group's
        own, longer, covers planning and loading)."""
        work.wait(timeout=datetime.timedelta(seconds=self.timeout_seconds))

    def send(self, tensor: torch.Tensor, peer: int, doing: str = "sending its stage's output") -> None:
        if tensor.dtype not in _DTYPES or tensor.dim() > _MOST_DIMS:
            raise ValueError(
                f"a stage sends tensors of {_DTYPES} with at most {_MOST_DIMS} dims, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        header = torch.zeros(2 + _MOST_DIMS, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        payload = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        start = time.perf_counter()
        try:
            self._wait(dist.isend(header, peer))
            if payload.numel():
                self._wait(dist.isend(payload, peer))
        except (RuntimeError, dist.DistError) as error:
            raise self._failed(error, peer, doing) from None
        self.seconds += time.perf_counter() - start
        self.sent_bytes += header.nbytes + payload.nbytes

    def recv(self, peer: int, device: torch.device, doing: str = "waiting for the stage before") -> torch.Tensor:
        header = torch.zeros(2 + _MOST_DIMS, dtype=torch.int64)
        start = time.perf_counter()
        try:
            self._wait(dist.irecv(header, peer))
            dtype, shape = self._announced(header, peer)
            payload = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8)
            if payload.numel():
                self._wait(dist.irecv(payload, peer))
        except StageError:
            raise
        except (RuntimeError, dist.DistError) as error:
            raise self._failed(error, peer, doing) from None
        self.seconds += time.perf_counter() - start
        return payload.view(dtype).reshape(shape).to(device)

    def _announced(self, header: torch.Tensor, peer: int) -> tuple[torch.dtype, list[int]]:
        """The dtype and shape a received header announces; a :class:`StageError` where no
        stage could have sent it (an unknown dtype, a negative or huge size)."""
        code, dims = int(header[0]), int(header[1])
        shape = [int(n) for n in header[2 : 2 + dims]] if 0 <= dims <= _MOST_DIMS else []
        dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else None
        total = dtype.itemsize if dtype is not None else 0
        for size in shape:
            total = total * size if size >= 0 else -1
            if not 0 <= total <= _MOST_BYTES:
                break
        if dtype is None or not 0 <= dims <= _MOST_DIMS or not 0 <= total <= _MOST_BYTES:
            raise StageError(
                f"rank {self.rank}: rank {peer} sent a header no stage makes: {header.tolist()}; the run ends",
                rank=self.rank,
                peer=peer,
            )
        return dtype, shape
