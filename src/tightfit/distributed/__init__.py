"""A model across several devices or processes: its layer stack cut into stages, each
planned within its own budget before any weight is read, run on ``torch.distributed``
(gloo between CPU processes). See docs/distributed.md."""

from tightfit.distributed.link import StageError
from tightfit.distributed.local import run_local
from tightfit.distributed.plan import EXACT, Stage, StagePlan, plan_stages
from tightfit.distributed.run import (
    RankReport,
    Ranks,
    StageRun,
    process_group,
    rank_device,
    ranks_from_environment,
    run_stage,
    shared_devices,
    shared_inputs,
    shared_plan,
)

__all__ = [
    "EXACT",
    "RankReport",
    "Ranks",
    "Stage",
    "StageError",
    "StagePlan",
    "StageRun",
    "plan_stages",
    "process_group",
    "rank_device",
    "ranks_from_environment",
    "run_local",
    "run_stage",
    "shared_devices",
    "shared_inputs",
    "shared_plan",
]
