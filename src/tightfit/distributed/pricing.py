"""What moving a stage's output to the next stage costs in the plan's time model: a
:class:`Hop` per pair of neighbouring stages, a latency per message and a bandwidth for its
bytes.

Between ranks the hops are measured when the ranks meet, before rank 0 plans
(:func:`measured_hops`): each pair of neighbours sends a small and a large tensor back and
forth through the very :class:`~tightfit.distributed.link.Link` the run uses, so that the
figure is of this network (or this machine's loopback) and this process group's backend.
Inside one process the copies between devices are priced from the devices' calibrations
(:func:`device_hop`): the bytes cross the host-to-device link of every accelerator on the
way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tightfit._validate import check_count, check_type
from tightfit.distributed.link import Link, check_seconds, collective
from tightfit.fitting.plan import _check_seconds as check_plan_seconds

__all__ = ["Hop", "device_hop", "host_legs", "measured_hops"]

#: The round trips of each size a measured hop times: the least of them is its figure.
ROUND_TRIPS = 8
#: The large message of a measured hop: enough bytes for its bandwidth to show over its latency.
LARGE_BYTES = 4 << 20


@dataclass(frozen=True)
class Hop:
    """One stage to the next: ``latency_seconds`` per message (its header and its data),
    ``bytes_per_second`` for the data, and ``how`` the figures were found."""

    latency_seconds: float
    bytes_per_second: float
    how: str

    def __post_init__(self) -> None:
        check_plan_seconds("Hop", "latency_seconds", self.latency_seconds)
        rate = self.bytes_per_second
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise ValueError(f"Hop.bytes_per_second must be a finite number > 0, got {rate!r}")
        check_type("Hop.how", self.how, str)

    def through_host(self, per_byte: float, devices: str) -> Hop:
        """The hop with ``per_byte`` more seconds per byte: the accelerators' copies to and
        from host memory (``devices``, named in ``how``) on either end."""
        if per_byte == 0:
            return self
        return Hop(
            self.latency_seconds,
            1 / (1 / self.bytes_per_second + per_byte),
            f"{self.how}, then through host memory from and to {devices}",
        )

    def seconds(self, messages: Sequence[tuple[int, int]]) -> float:
        """What ``messages`` cost: (how many, data bytes each) pairs."""
        return sum(count * (self.latency_seconds + nbytes / self.bytes_per_second) for count, nbytes in messages)


def host_legs(source: str, target: str, calibrations: Mapping[str, Mapping[str, Any] | None]) -> float:
    """Seconds per byte that a tensor moved from ``source`` to ``target`` through host
    memory spends crossing each accelerator's host-to-device link (``calibrations``: device
    -> its plan's calibration figures); 0 between CPUs."""
    per_byte = 0.0
    for device in (source, target):
        if device == "cpu":
            continue
        figures = calibrations.get(device) or {}
        bandwidth = figures.get("host_to_device_bandwidth")
        if not bandwidth:
            raise ValueError(f"the calibration of {device} has no host_to_device_bandwidth to price its copies with")
        per_byte += 1 / bandwidth
    return per_byte


def device_hop(source: str, target: str, calibrations: Mapping[str, Mapping[str, Any] | None]) -> Hop:
    """The copy from device ``source`` to ``target`` in one process, priced by
    :func:`host_legs`; the calibration measures no latency, so a copy has none."""
    per_byte = host_legs(source, target, calibrations)
    if per_byte == 0:
        raise ValueError(f"{source} to {target}: stages of one process are on different devices")
    return Hop(0.0, 1 / per_byte, f"{source} to {target} at the calibrated host-to-device bandwidth")


def measured_hops(rank: int, world: int, timeout_seconds: float) -> list[Hop]:
    """Every hop of the ring of ``world`` ranks (hop ``r``: rank ``r`` to ``(r + 1) % world``,
    the last carrying a generation's tokens back to the first), measured by the two ranks
    it joins and shared with every rank; called by every rank of the process group at once."""
    check_count("world", world, least=2)
    check_count("rank", rank)
    if rank >= world:
        raise ValueError(f"rank={rank} must be below world={world}")
    check_seconds("timeout_seconds", timeout_seconds)
    if not dist.is_initialized():
        raise ValueError("measured_hops runs in the ranks' process group: call it inside process_group(...)")
    link = Link(rank, timeout_seconds)
    mine: Hop | None = None
    for sender in range(world):  # in this order no rank waits on one still busy with another hop
        receiver = (sender + 1) % world
        if rank == sender:
            mine = _timed_hop(link, receiver)
        elif rank == receiver:
            _answer(link, sender)
    hops: list[Any] = [None] * world
    collective(lambda: dist.all_gather_object(hops, mine), rank, "sharing the measured links")
    return hops


def _messages() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, dtype=torch.uint8), torch.zeros(LARGE_BYTES, dtype=torch.uint8)


def _timed_hop(link: Link, peer: int) -> Hop:
    """Round trips of a one-byte and a large message to ``peer``; the least of each, halved,
    is a message's time one way."""
    one_way = []
    for message in _messages():
        trips = []
        for _ in range(ROUND_TRIPS):
            start = time.perf_counter()
            link.send(message, peer, "measuring the link")
            link.recv(peer, torch.device("cpu"), "measuring the link")
            trips.append(time.perf_counter() - start)
        one_way.append(min(trips) / 2)
    latency, large = one_way
    bandwidth = LARGE_BYTES / max(large - latency, 1e-9)
    return Hop(
        latency,
        bandwidth,
        f"to rank {peer}: {latency * 1e6:.0f} us a message + {bandwidth / 1e9:.2f} GB/s (measured: the least of "
        f"{ROUND_TRIPS} round trips)",
    )


def _answer(link: Link, peer: int) -> None:
    for message in _messages():
        for _ in range(ROUND_TRIPS):
            link.recv(peer, torch.device("cpu"), "measuring the link")
            link.send(message, peer, "measuring the link")
