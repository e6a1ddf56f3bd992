from __future__ import annotations

from dlfleet.brain.optimizer.initial import MIB, InitialSettings, JobHistory, initial_plan
from dlfleet.brain.records import JobInfo, PlanKind, RoundMetrics

GIB = 1 << 30
JOB = JobInfo(
    name="run-3",
    signature="resnet50/imagenet/bs256",
    min_nodes=1,
    max_nodes=16,
    initial_nodes=2,
    memory_request_bytes=4 * GIB,
    cpu_request=2.0,
)


def rounds(rates: dict[int, float]) -> list[RoundMetrics]:
    return [
        RoundMetrics(i, n, n * 4, 0, 120_000, rate) for i, (n, rate) in enumerate(rates.items())
    ]


def test_without_history_the_job_starts_from_its_config() -> None:
    plan = initial_plan(JOB, [], InitialSettings())
    assert (plan.kind, plan.target_nodes, plan.memory_bytes, plan.cpu) == (
        PlanKind.INITIAL,
        2,
        4 * GIB,
        2.0,
    )
    assert "no earlier run" in plan.reason


def test_history_picks_the_most_throughput_above_the_efficiency_threshold() -> None:
    # Efficiency: 4 -> 0.95, 8 -> 0.75, 12 -> 0.6 (below 0.7): 8 nodes.
    history = [
        JobHistory(
            "run-1", rounds({2: 200.0, 4: 380.0}), peak_rss_bytes=6 * GIB, peak_cpu_percent=150.0
        ),
        JobHistory("run-2", rounds({8: 600.0, 12: 720.0}), peak_rss_bytes=5 * GIB, ooms=1),
    ]
    plan = initial_plan(JOB, history, InitialSettings())
    assert plan.target_nodes == 8
    assert plan.memory_bytes == 7680 * MIB  # 6 GiB peak x 1.25
    assert plan.cpu == 1.9  # 150% x 1.25, rounded up to a tenth of a core
    assert plan.evidence["efficiency"] == {"2": 1.0, "4": 0.95, "8": 0.75, "12": 0.6}
    assert plan.evidence["history"] == ["run-1", "run-2"]
    assert "8 nodes gave 600.0 samples/s" in plan.reason and "1 OOM" in plan.reason


def test_the_choice_is_clamped_to_the_jobs_range() -> None:
    history = [JobHistory("run-1", rounds({4: 400.0, 8: 800.0}))]
    small = JobInfo(name="x", signature=JOB.signature, min_nodes=1, max_nodes=6)
    plan = initial_plan(small, history, InitialSettings())
    assert plan.target_nodes == 6
    assert "clamped to 6" in plan.reason


def test_history_without_measured_rounds_keeps_the_configured_size() -> None:
    history = [JobHistory("run-1", [RoundMetrics(1, 8, 8, 0, 1_000, 50.0)])]
    assert initial_plan(JOB, history, InitialSettings()).target_nodes == 2
