"""Running a :class:`~tightfit.distributed.StagePlan` on ``torch.distributed``: each rank
streams only its stage's tensors from the checkpoint into its stage's plan, then the
stages run in turn, each rank sending its hidden states to the next
(:class:`~tightfit.distributed.link.Link`). A causal LM generates greedily, each stage
keeping its own layers' KV cache; the last rank picks each token and sends it back to the
first. An encoder's last rank returns the mean-pooled sentence embeddings.

Every rank measures itself as a single run is measured (live tensors on the CPU, the
allocator's peak on an accelerator, the process's peak RSS, the bytes it read from the
checkpoint files) and rank 0 gathers the reports into one table. A rank that fails (a peer
died or stopped answering) raises :class:`~tightfit.distributed.link.StageError` and
leaves the process group, so every other rank fails too, within the process group's
timeout at worst.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tightfit._validate import check_count, check_type
from tightfit.app.budget import Loaded, measure_load
from tightfit.distributed.link import Link, check_seconds, collective
from tightfit.distributed.measured import Timed, timed_and_measured
from tightfit.distributed.plan import StagePlan
from tightfit.distributed.split import cut
from tightfit.distributed.step import StageStep
from tightfit.fitting import FitError
from tightfit.fitting.held import held_bytes
from tightfit.kinds import CAUSAL_LM
from tightfit.loading.folder import skeleton
from tightfit.loading.stream import load

__all__ = [
    "RankReport",
    "Ranks",
    "StageRun",
    "process_group",
    "rank_device",
    "ranks_from_environment",
    "run_stage",
    "shared_devices",
    "shared_inputs",
    "shared_plan",
]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world``, and where the process group
    meets (``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        check_count("Ranks.world", self.world, least=1)
        check_count("Ranks.rank", self.rank)
        if self.rank >= self.world:
            raise ValueError(f"Ranks.rank={self.rank} must be below Ranks.world={self.world}")


def ranks_from_environment(environ: Mapping[str, str] = os.environ) -> Ranks:
    """The :class:`Ranks` ``torchrun`` gives this process; rank 0 of 1 outside it."""
    check_type("environ", environ, Mapping)
    try:
        rank, world = int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(
            f"RANK={environ.get('RANK')!r} and WORLD_SIZE={environ.get('WORLD_SIZE')!r} must be integers"
        ) from None
    try:
        return Ranks(rank, world)
    except ValueError as error:
        raise ValueError(f"RANK={rank}, WORLD_SIZE={world}: {error}") from None


@contextlib.contextmanager
def process_group(ranks: Ranks, timeout_seconds: float, setup_seconds: float = 600.0) -> Iterator[None]:
    """Joins the run's process group (gloo; only where there are several ranks) for the
    block and leaves it after, also on failure, so that no rank is left waiting on it.
    ``setup_seconds``: how long a rank waits for the others through planning and loading
    (the group's own timeout); ``timeout_seconds``, for one message while the stages run,
    is the links' (:func:`run_stage` takes it)."""
    check_type("ranks", ranks, Ranks)
    check_seconds("timeout_seconds", timeout_seconds)
    setup = check_seconds("setup_seconds", setup_seconds)
    joined = ranks.world > 1 and not dist.is_initialized()
    if joined:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(setup, timeout_seconds)))
    try:
        yield
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def shared_plan(make: Callable[[], StagePlan], ranks: Ranks) -> StagePlan:
    """The plan rank 0 makes with ``make()``, on every rank: the ranks agree on it without
    each planning, and where rank 0 cannot plan, every rank raises (rank 0 its own error,
    the others a ValueError quoting it), before any weight is read."""
    if ranks.world == 1:
        return make()
    made: Any = None
    failure: Exception | None = None
    if ranks.rank == 0:
        try:
            made = ("plan", make().to_json())
        except (FitError, ValueError, TypeError) as error:
            failure, made = error, ("error", str(error))
    what, text = _from_rank_zero(made, ranks, "sharing the plan")
    if failure is not None:
        raise failure
    if what == "error":
        raise ValueError(f"rank {ranks.rank}: rank 0 could not plan the stages: {text}")
    return StagePlan.from_json(text)


def rank_device(device_type: str, local_rank: int) -> str:
    """The device a rank computes on: the CPU, or the accelerator of ``device_type`` at its
    index on the node (``LOCAL_RANK``, which torchrun sets), one per rank."""
    check_type("device_type", device_type, str)
    check_count("local_rank", local_rank)
    try:
        parsed = torch.device(device_type)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.index is not None:
        raise ValueError(
            f"device_type={device_type!r} must be a device type without an index ('cpu', 'cuda', 'xpu', ...): "
            f"each rank takes the device of its local rank"
        )
    if parsed.type == "cpu":
        return "cpu"
    module = getattr(torch, parsed.type, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} has no {parsed.type} device of its own: this node has {count}; start at most "
            f"{count} ranks per node (torchrun --nproc-per-node)"
        )
    return f"{parsed.type}:{local_rank}"


def shared_devices(device: str, ranks: Ranks) -> list[str]:
    """Every rank's device, each rank giving its own ``device``: what rank 0 plans with."""
    if ranks.world == 1:
        return [device]
    devices: list[Any] = [None] * ranks.world
    collective(lambda: dist.all_gather_object(devices, device), ranks.rank, "sharing the ranks' devices")
    return devices


def shared_inputs(inputs: Mapping[str, torch.Tensor], ranks: Ranks) -> dict[str, torch.Tensor]:
    """Rank 0's ``inputs`` on every rank, whatever each rank made of its own (a sentences
    file read on each node): the stages of one run must work on the same batch."""
    check_type("inputs", inputs, Mapping)
    return dict(inputs) if ranks.world == 1 else _from_rank_zero(dict(inputs), ranks, "sharing the inputs")


def _from_rank_zero(value: Any, ranks: Ranks, doing: str) -> Any:
    """Rank 0's ``value`` on every rank (each rank's own is ignored but rank 0's)."""
    box: list[Any] = [value if ranks.rank == 0 else None]
    collective(lambda: dist.broadcast_object_list(box, src=0), ranks.rank, doing)
    return box[0]


@dataclass(frozen=True)
class RankReport:
    """What one rank measured: its peak (running, and while loading) against its
    prediction and budget, the bytes it read from the checkpoint files (the process's read
    calls while loading) against its stage's tensor bytes, its times per run (the whole
    call, waiting for its peers included; in send and receive; its stage's compute and
    sends as predicted, the sends None where not priced) and the bytes it sent per run
    against the plan's."""

    rank: int
    device: str
    holds: str
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    peak_rss_bytes: int | None
    load_peak_bytes: int
    predicted_load_peak_bytes: int
    read_bytes: int | None
    stage_read_bytes: int
    load_seconds: float
    seconds: float
    predicted_seconds: float
    link_seconds: float
    predicted_send_seconds: float | None
    sent_bytes: int
    predicted_sent_bytes: int
    measured_by: str

    @property
    def within_budget(self) -> bool:
        """Whether the rank stayed within its budget, running and while loading."""
        return max(self.measured_peak_bytes, self.load_peak_bytes) <= self.budget_bytes


@dataclass(frozen=True)
class StageRun:
    """A run across the stages, as rank 0 has it: every rank's report, and the result
    (a causal LM's generated tokens; an encoder's embeddings) with its tokens/s."""

    plan: StagePlan
    reports: tuple[RankReport, ...]
    tokens: tuple[int, ...]
    embeddings: torch.Tensor | None
    seconds: float

    @classmethod
    def of(cls, plan: StagePlan, reports: tuple[RankReport, ...], result: Any, seconds: float) -> StageRun:
        """The run whose last stage returned ``result``: a generation's tokens, or the embeddings."""
        generated = plan.kind == CAUSAL_LM
        return cls(plan, reports, tuple(result) if generated else (), None if generated else result, seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.plan.model,
            "kind": self.plan.kind,
            "ranks": len(self.reports),
            "seconds": self.seconds,
            "tokens": list(self.tokens),
            "reports": [asdict(r) | {"within_budget": r.within_budget} for r in self.reports],
        }


def _read_calls_bytes() -> int | None:
    """Bytes this process has read through read calls (Linux's ``rchar``), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def load_stage(folder: str | Path, plan: StagePlan, index: int) -> tuple[Any, Loaded, int | None]:
    """(model, what loading took, bytes the process's read calls took meanwhile): stage
    ``index`` of ``plan`` cut from the folder's skeleton and streamed into its plan, its
    own tensors only."""
    stage = plan.stages[index]
    model, _ = skeleton(folder, plan.kind)
    cut(model, plan.kind, stage.start, stage.end)
    before = _read_calls_bytes()
    loaded = measure_load(
        lambda: load(folder, plan=stage.plan, model=model, kind=plan.kind)[0], torch.device(stage.device)
    )
    after = _read_calls_bytes()
    return loaded.model, loaded, None if before is None or after is None else after - before


def stage_report(
    plan: StagePlan, index: int, loaded: Loaded, read: int | None, timed: Timed, sent_bytes: int
) -> RankReport:
    """Stage ``index``'s :class:`RankReport` from what loading and the measured run found;
    ``sent_bytes``: what it sent per call."""
    stage = plan.stages[index]
    device = torch.device(stage.device)
    return RankReport(
        rank=index,
        device=str(device),
        holds=stage.holds(plan.layers, plan.kind),
        budget_bytes=stage.budget_bytes,
        predicted_peak_bytes=stage.predicted_peak_bytes,
        measured_peak_bytes=timed.peaks[device],
        peak_rss_bytes=timed.peak_rss,
        load_peak_bytes=loaded.peak_bytes,
        predicted_load_peak_bytes=stage.plan.predicted_load_peak_bytes,
        read_bytes=read,
        stage_read_bytes=stage.read_bytes,
        load_seconds=loaded.seconds,
        seconds=timed.seconds,
        predicted_seconds=stage.compute_seconds,
        link_seconds=timed.counted,
        predicted_send_seconds=stage.send_seconds,
        sent_bytes=sent_bytes,
        predicted_sent_bytes=stage.sent_bytes,
        measured_by=timed.measured_by[device],
    )


def _stage_call(
    step: StageStep, rank: int, world: int, link: Link, new_tokens: int, parts: list[slice]
) -> Callable[[], Any]:
    """One run of this rank's part: a generation of ``new_tokens`` tokens or one encoding,
    micro-batch by micro-batch (``parts``: their rows); the last rank's call returns the
    tokens or the embeddings, the others' None."""
    first, last = step.first, step.last

    def encode() -> torch.Tensor | None:
        embeddings = None
        for rows in parts:
            out = step(step.ids[rows] if first else link.recv(rank - 1, step.device), {}, rows=rows)
            if last:
                embeddings = step.into_batch(embeddings, out, rows, len(parts))
            else:
                link.send(out, rank + 1)
            del out  # not held through the next part's forward
        return embeddings

    def generate() -> tuple[int, ...] | None:
        cache = step.new_cache()
        tokens: list[int] = []
        taken = step.ids
        for index in range(new_tokens):
            if not first:
                taken = link.recv(rank - 1, step.device)
            out = step(taken, cache, index)
            if not last:
                link.send(out, rank + 1)
            else:
                tokens.append(int(out))
                if world > 1 and index < new_tokens - 1:
                    link.send(out, 0, "sending the next token to rank 0")
            if first and index < new_tokens - 1:
                taken = out if last else link.recv(world - 1, step.device, "waiting for the next token")
            del out  # not held through the next step's forward, as a single process holds nothing of it
        return tuple(tokens) if last else None

    return generate if step.kind == CAUSAL_LM else encode


def run_stage(
    folder: str | Path,
    plan: StagePlan,
    inputs: Mapping[str, torch.Tensor],
    ranks: Ranks,
    *,
    max_new_tokens: int = 0,
    repeat: int = 3,
    timeout_seconds: float = 60.0,
) -> StageRun | None:
    """Run this rank's stage of ``plan`` with every other rank (the process group is
    joined here and left on return, also on failure) and return the whole run's
    :class:`StageRun` on rank 0 (None on the others). ``inputs``: the first stage's, the
    same on every rank; ``max_new_tokens``: a causal LM's tokens to generate; ``repeat``:
    timed runs after a warm-up, then one measured run; ``timeout_seconds``: the longest a
    rank waits on a peer before the run ends with :class:`StageError`."""
    check_type("plan", plan, StagePlan)
    check_type("ranks", ranks, Ranks)
    timeout_seconds = check_seconds("timeout_seconds", timeout_seconds)
    if ranks.world != len(plan.stages):
        raise ValueError(f"the plan has {len(plan.stages)} stages; this run has {ranks.world} ranks (WORLD_SIZE)")
    check_count("repeat", repeat, least=1)
    plan.check_run(inputs, max_new_tokens)
    stage = plan.stages[ranks.rank]
    device = torch.device(stage.device)
    with process_group(ranks, timeout_seconds):
        model, loaded, read = load_stage(folder, plan, ranks.rank)
        if ranks.world > 1:  # every rank loaded before any waits on another's message
            collective(dist.barrier, ranks.rank, "waiting for every rank to load its stage")
        link = Link(ranks.rank, timeout_seconds)
        step = StageStep(model, plan.kind, ranks.rank, ranks.world, device, inputs)
        call = _stage_call(step, ranks.rank, ranks.world, link, max_new_tokens, plan.micro_batch_rows())
        together = (
            (lambda: collective(dist.barrier, ranks.rank, "starting a run together"))
            if ranks.world > 1
            else (lambda: None)
        )
        timed = timed_and_measured(call, {device: held_bytes(model, device)}, repeat, lambda: link.seconds, together)
        report = stage_report(plan, ranks.rank, loaded, read, timed, link.sent_bytes // timed.calls)
        mine = (report, timed.result if ranks.rank == ranks.world - 1 else None)
        gathered = [mine] if ranks.world == 1 else ([None] * ranks.world if ranks.rank == 0 else None)
        if ranks.world > 1:
            collective(lambda: dist.gather_object(mine, gathered, dst=0), ranks.rank, "gathering the reports")
        if ranks.rank != 0:
            return None
        reports = tuple(report for report, _ in gathered)
        return StageRun.of(plan, reports, gathered[-1][1], max(r.seconds for r in reports))
