"""Sending a stage's tensors to the next rank over ``torch.distributed`` point-to-point
calls, timed, with every failure of a peer turned into a :class:`StageError` that names it.

Tensors travel as their bytes through host memory (a small header first: dtype and
shape), so that any two ranks exchange them whatever devices they compute on and
whatever dtypes the process group's backend supports; gloo carries them between CPU
processes. A peer that dies closes its connections and the waiting rank fails at once; a
peer that stops answering fails the wait after the process group's timeout.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["HEADER_BYTES", "Link", "StageError", "message_bytes"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8)
_MOST_DIMS = 6
#: The header before each tensor: its dtype, its number of dims and its shape, as int64.
HEADER_BYTES = (2 + _MOST_DIMS) * 8


def message_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes a tensor of ``shape`` and ``dtype`` takes on the wire: its header and its data."""
    return HEADER_BYTES + torch.Size(shape).numel() * dtype.itemsize


class StageError(RuntimeError):
    """A rank's stage could not go on: a peer died or did not answer in time. ``rank``:
    this rank; ``peer``: the rank it was waiting on or sending to (None where unknown)."""

    def __init__(self, message: str, *, rank: int, peer: int | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


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
            dist.send(header, peer)
            if payload.numel():
                dist.send(payload, peer)
        except (RuntimeError, dist.DistError) as error:
            raise self._failed(error, peer, doing) from None
        self.seconds += time.perf_counter() - start
        self.sent_bytes += header.nbytes + payload.nbytes

    def recv(self, peer: int, device: torch.device, doing: str = "waiting for the stage before") -> torch.Tensor:
        header = torch.zeros(2 + _MOST_DIMS, dtype=torch.int64)
        start = time.perf_counter()
        try:
            dist.recv(header, peer)
            code, dims = int(header[0]), int(header[1])
            if not (0 <= code < len(_DTYPES) and 0 <= dims <= _MOST_DIMS):
                raise StageError(
                    f"rank {self.rank}: rank {peer} sent a header it cannot have made: {header.tolist()}",
                    rank=self.rank,
                    peer=peer,
                )
            dtype, shape = _DTYPES[code], [int(n) for n in header[2 : 2 + dims]]
            payload = torch.empty(torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8)
            if payload.numel():
                dist.recv(payload, peer)
        except (RuntimeError, dist.DistError) as error:
            if isinstance(error, StageError):
                raise
            raise self._failed(error, peer, doing) from None
        self.seconds += time.perf_counter() - start
        return payload.view(dtype).reshape(shape).to(device)
