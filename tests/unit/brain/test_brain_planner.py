"""One plan per request, the most urgent first."""

from __future__ import annotations

from dlfleet.brain.optimizer.planner import OptimizerSettings, PlanContext, decide
from dlfleet.brain.records import (
    JobInfo,
    NodeSample,
    OomRelaunch,
    Plan,
    PlanId,
    PlanKind,
    PlanRequest,
    RoundMetrics,
)

GIB = 1 << 30
NOW = 10_000_000
JOB = JobInfo(name="j", signature="s", min_nodes=1, max_nodes=8, memory_limit_bytes=2 * GIB)
ROUNDS = [RoundMetrics(1, 2, 2, NOW - 120_000, NOW, 200.0)]
SLOW_C = [
    NodeSample(node, 1, NOW - j * 30_000 - 5_000, step_time_s=3.0 if node == "c" else 1.0)
    for node in "abc"
    for j in range(3)
]


def test_a_job_not_started_gets_its_initial_plan() -> None:
    plan = decide(PlanContext(PlanRequest(JOB, nodes=0), NOW), OptimizerSettings())
    assert (plan.kind, plan.target_nodes) == (PlanKind.INITIAL, 8)


def test_an_oom_relaunch_comes_before_stragglers_and_scaling() -> None:
    request = PlanRequest(JOB, nodes=3, oom_relaunch=OomRelaunch("b", 0))
    ctx = PlanContext(request, NOW, rounds=ROUNDS, recent_samples=SLOW_C)
    plan = decide(ctx, OptimizerSettings())
    # The relaunch names no limit: the job's 2 GiB is the one it was killed at.
    assert (plan.kind, plan.node, plan.memory_bytes) == (PlanKind.MEMORY, "b", 3 * GIB)


def test_a_straggler_comes_before_scaling() -> None:
    ctx = PlanContext(PlanRequest(JOB, nodes=2), NOW, rounds=ROUNDS, recent_samples=SLOW_C)
    plan = decide(ctx, OptimizerSettings())
    assert (plan.kind, plan.node) == (PlanKind.REPLACE_NODE, "c")


def test_a_straggler_replaced_within_the_horizon_is_not_replaced_again() -> None:
    replaced = Plan(
        id=PlanId(1),
        job="j",
        kind=PlanKind.REPLACE_NODE,
        reason="",
        evidence={},
        created_ms=NOW - 20_000,
        node="c",
        applied=True,
        applied_ms=NOW - 20_000,
    )
    ctx = PlanContext(
        PlanRequest(JOB, nodes=2), NOW, rounds=ROUNDS, recent_samples=SLOW_C, plans=[replaced]
    )
    plan = decide(ctx, OptimizerSettings())
    assert (plan.kind, plan.target_nodes) == (PlanKind.SCALE, 3)
