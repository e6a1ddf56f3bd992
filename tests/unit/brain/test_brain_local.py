"""`LocalBrain` on an in-memory SQLite: what it stores, what it answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from unit.brain.brain_simulation import ROUND_MS, knee

from dlfleet.api.errors import NotFound
from dlfleet.brain.local import LocalBrain
from dlfleet.brain.records import (
    FailureKind,
    FailureRecord,
    JobInfo,
    MetricsBatch,
    OomRelaunch,
    PlanId,
    PlanKind,
    PlanRequest,
    RoundMetrics,
)

GIB = 1 << 30
JOB = JobInfo(name="run-1", signature="sig", min_nodes=1, max_nodes=8, initial_nodes=1)


class Clock:
    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def brain(clock: Clock) -> Iterator[LocalBrain]:
    b = LocalBrain.open("sqlite://", clock=clock)
    yield b
    b.close()


def run_job(brain: LocalBrain, clock: Clock, polls: int) -> list[int]:
    """The master's loop: measure a round, ask, apply."""
    nodes, curve = 1, knee(4)
    for number in range(1, polls + 1):
        start = clock.ms
        clock.ms += ROUND_MS
        rounds = [RoundMetrics(number, nodes, nodes, start, clock.ms, curve(nodes))]
        brain.persist(MetricsBatch(JOB.name, JOB, rounds))
        plan = brain.plan(PlanRequest(JOB, nodes))
        if plan.kind is PlanKind.SCALE:
            brain.mark_applied(plan.id)
            nodes = plan.target_nodes
    return [p.target_nodes for p in brain.report(JOB.name).plans]


def test_the_knee_is_found_through_the_database(brain: LocalBrain, clock: Clock) -> None:
    assert run_job(brain, clock, 20) == [2, 4, 8, 4]
    report = brain.report(JOB.name)
    assert [(s.nodes, s.samples_per_s) for s in report.sizes] == [
        (1, 100.0),
        (2, 200.0),
        (4, 400.0),
        (8, 400.0),
    ]
    assert all(p.applied and p.reason for p in report.plans)


def test_asking_again_returns_the_same_unapplied_plan(brain: LocalBrain, clock: Clock) -> None:
    brain.persist(MetricsBatch(JOB.name, JOB, [RoundMetrics(1, 1, 1, 0, ROUND_MS, 100.0)]))
    first = brain.plan(PlanRequest(JOB, 1))
    clock.ms += 5_000
    again = brain.plan(PlanRequest(JOB, 1))
    assert first.kind is PlanKind.SCALE and again == first
    assert len(brain.report(JOB.name).plans) == 1


def test_none_is_answered_with_a_reason_and_not_stored(brain: LocalBrain) -> None:
    plan = brain.plan(PlanRequest(JOB, 1))
    assert (plan.kind, plan.id) == (PlanKind.NONE, 0)
    assert "no round measured yet" in plan.reason
    assert brain.report(JOB.name).plans == []


def test_initial_plan_learns_from_earlier_runs_of_the_signature(brain: LocalBrain) -> None:
    rounds = [
        RoundMetrics(i, n, n, 0, 120_000, 100.0 * min(n, 3)) for i, n in enumerate((1, 2, 3, 4))
    ]
    brain.persist(
        MetricsBatch("run-0", JobInfo(name="run-0", signature="sig", max_nodes=8), rounds)
    )
    plan = brain.plan(PlanRequest(JOB, 0))
    assert (plan.kind, plan.target_nodes) == (PlanKind.INITIAL, 3)
    other = JobInfo(name="other", signature="another", max_nodes=8, initial_nodes=5)
    assert brain.plan(PlanRequest(other, 0)).target_nodes == 5


def test_memory_after_oom_uses_the_peak_rss_the_node_reported(brain: LocalBrain) -> None:
    from dlfleet.brain.records import NodeSample

    brain.persist(
        MetricsBatch(
            JOB.name,
            JOB,
            samples=[NodeSample("n1", 1, 1, memory_rss_bytes=5 * GIB)],
            failures=[FailureRecord("n1", FailureKind.OOM, 2, 137, "OOMKilled")],
        )
    )
    plan = brain.plan(PlanRequest(JOB, 2, oom_relaunch=OomRelaunch("n1", 4 * GIB)))
    assert (plan.kind, plan.node, plan.memory_bytes) == (PlanKind.MEMORY, "n1", 6 * GIB)
    assert brain.report(JOB.name).failures == {FailureKind.OOM: 1}


def test_unknown_jobs_and_plans_are_not_found(brain: LocalBrain) -> None:
    with pytest.raises(NotFound):
        brain.persist(MetricsBatch("nobody", None, [RoundMetrics(1, 1, 1, 0, 1, 1.0)]))
    with pytest.raises(NotFound):
        brain.mark_applied(PlanId(99))
    with pytest.raises(NotFound):
        brain.report("nobody")
