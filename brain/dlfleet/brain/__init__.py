"""The brain: job metrics in a database and resource plans for the master.

This package is its public entry: the master (the job supervisor) imports
only the names below, from `dlfleet.brain` itself, never a module under it
(an import contract in pyproject.toml says so):
- `BrainApi`, `open_brain`: an in-process brain or a `dlbrain` service;
- the values that cross it (`JobInfo`, `RoundMetrics`, `NodeSample`,
  `FailureRecord`, `MetricsBatch`, `PlanRequest`, `Plan`, ...);
- `BrainReporter`: metrics sent without blocking;
- `OptimizerSettings` and its parts, for an in-process brain.

Underneath: `optimizer` (pure decisions), `repository`/`models`/`schema`
(SQLAlchemy and Alembic), `server`/`client`/`wire` (gRPC), `cli` (`dlbrain`).
Nothing here imports the master, the worker or torch; importing this package
imports no database or gRPC library (those load when a brain is opened).
"""

from dlfleet.brain.api import BrainApi, open_brain
from dlfleet.brain.optimizer.initial import InitialSettings
from dlfleet.brain.optimizer.planner import OptimizerSettings
from dlfleet.brain.optimizer.scaling import ScalingSettings
from dlfleet.brain.records import (
    FailureKind,
    FailureRecord,
    JobInfo,
    JobStatus,
    NodeCheckRecord,
    NodeSample,
    OomRelaunch,
    Plan,
    PlanKind,
    PlanRequest,
    RoundMetrics,
)
from dlfleet.brain.reporter import BrainReporter

__all__ = [
    "BrainApi",
    "BrainReporter",
    "FailureKind",
    "FailureRecord",
    "InitialSettings",
    "JobInfo",
    "JobStatus",
    "NodeCheckRecord",
    "NodeSample",
    "OomRelaunch",
    "OptimizerSettings",
    "Plan",
    "PlanKind",
    "PlanRequest",
    "RoundMetrics",
    "ScalingSettings",
    "open_brain",
]
