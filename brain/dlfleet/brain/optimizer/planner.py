"""One plan per request, by urgency: the initial plan of a job not started
yet; else memory for a node being relaunched after an OOM kill; else the
replacement of a straggler; else the node count. Pure: the caller loads what
the job measured and passes the time."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dlfleet.brain.optimizer.initial import InitialSettings, JobHistory, initial_plan
from dlfleet.brain.optimizer.memory import MemorySettings, memory_after_oom
from dlfleet.brain.optimizer.scaling import (
    ScalingSettings,
    ScalingState,
    abandonments,
    decide_scaling,
    step_origin,
)
from dlfleet.brain.optimizer.stragglers import StragglerSettings, find_straggler
from dlfleet.brain.records import (
    Decision,
    NodeCheckRecord,
    NodeSample,
    Plan,
    PlanKind,
    PlanRequest,
    RoundMetrics,
)


@dataclass(frozen=True)
class OptimizerSettings:
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    initial: InitialSettings = field(default_factory=InitialSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    stragglers: StragglerSettings = field(default_factory=StragglerSettings)


@dataclass(frozen=True)
class PlanContext:
    """What the planner needs about one job, loaded by the caller."""

    request: PlanRequest
    now_ms: int
    rounds: Sequence[RoundMetrics] = ()  # this job's
    recent_samples: Sequence[NodeSample] = ()  # at least the stragglers' horizon
    peak_rss_bytes: int = 0  # of the node being relaunched (else of the job), 0: unknown
    plans: Sequence[Plan] = ()  # this job's, oldest first
    history: Sequence[JobHistory] = ()  # earlier runs of the same signature
    node_checks: Mapping[str, NodeCheckRecord] = field(default_factory=dict)  # latest per node


def recently_replaced(plans: Sequence[Plan], since_ms: int) -> frozenset[str]:
    return frozenset(
        p.node
        for p in plans
        if p.kind is PlanKind.REPLACE_NODE and p.applied and (p.applied_ms or 0) >= since_ms
    )


def decide(ctx: PlanContext, settings: OptimizerSettings) -> Decision:
    request, job = ctx.request, ctx.request.job
    if request.nodes == 0:
        return initial_plan(job, ctx.history, settings.initial)
    if request.oom_relaunch is not None:
        relaunch = request.oom_relaunch
        if relaunch.memory_limit_bytes == 0:  # not given: the job's limit as the master knows it
            limit = request.memory_limit_bytes or job.memory_limit_bytes
            relaunch = dataclasses.replace(relaunch, memory_limit_bytes=limit)
        return memory_after_oom(relaunch, ctx.peak_rss_bytes, settings.memory)
    horizon = settings.stragglers.horizon_ms
    straggler = find_straggler(
        ctx.recent_samples,
        ctx.now_ms,
        settings.stragglers,
        recently_replaced(ctx.plans, ctx.now_ms - horizon),
        ctx.node_checks,
    )
    if straggler is not None:
        return straggler
    state = ScalingState(
        min_nodes=job.min_nodes,
        max_nodes=job.max_nodes,
        nodes=request.nodes,
        rounds=ctx.rounds,
        abandoned=abandonments(ctx.plans),
        came_from=step_origin(ctx.plans, request.nodes),
    )
    return decide_scaling(state, settings.scaling)
