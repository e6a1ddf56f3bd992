"""BrainLink: what the master's status becomes in the brain (a real
in-process brain on a SQLite file)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dlfleet.api.v1 import job_pb2, rendezvous_pb2
from dlfleet.brain.local import LocalBrain
from dlfleet.brain.records import FailureKind, Plan, PlanId, PlanKind
from dlfleet.brain.report import render_text
from dlfleet.master.job import brain_link
from dlfleet.master.job.brain_link import BrainLink, signature
from dlfleet.master.job.jobconfig import parse_job_config
from dlfleet.master.job.platform import REASON_OOM, Node, NodeState
from dlfleet.master.job.tally import SupervisorTally


@pytest.fixture
def config(tmp_path: Path):  # type: ignore[no-untyped-def]
    (tmp_path / "train.py").write_text("")
    return parse_job_config(
        {"name": "demo", "command": "train.py", "nodes": {"min": 1, "max": 4},
         "brain": {"mode": "advise"}},
        base_dir=tmp_path,
    )  # fmt: skip


def view(round_: int, samples: list[float]) -> job_pb2.MasterStatus:
    status = job_pb2.MasterStatus(
        round=round_, world_size=len(samples), round_nodes=len(samples), now_unix_ms=200
    )
    for i, rate in enumerate(samples):
        metrics = rendezvous_pb2.NodeMetrics(
            samples_per_second=rate, step_time_ms=50, steps=10, rss_bytes=1 << 20, cpu_percent=90
        )
        status.nodes.append(
            job_pb2.NodeReport(node_id=f"node-{i}#1", metrics=metrics, at_unix_ms=100)
        )
    return status


def test_rounds_nodes_and_failures_reach_the_brain(config, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(brain_link, "REPORT_EVERY_S", 0.0)
    clock = iter(range(1_795_000_000_000, 1_796_000_000_000, 1_000))  # a second per call
    monkeypatch.setattr(brain_link, "now_ms", lambda: next(clock))
    config.work_dir.mkdir(parents=True)
    link = BrainLink(config, token="t")
    link.open()
    assert link.enabled and link.info is not None
    run = link.info.name
    assert link.initial_nodes(4) == 4  # advice only: the config's size stands
    assert "start with" in link.last_plan and "advice" in link.last_plan
    nodes = [Node(name="node-0", index=0, state=NodeState.RUNNING),
             Node(name="node-1", index=1, state=NodeState.RUNNING)]  # fmt: skip
    for rates in ([40.0, 41.0], [39.0, 40.0], [41.0, 40.0]):
        link.observe(view(1, rates), nodes)
    link.observe(view(2, [50.0]), nodes[:1])  # a new round: round 1 ends
    link.node_ended(nodes[1], 137, REASON_OOM, lost=True)
    assert link.reporter is not None
    reporter = link.reporter
    link.close(0)
    stats = reporter.stats()
    assert stats.dropped == 0 and stats.pending == 0, stats

    brain = LocalBrain.open(config.brain_db_url)
    try:
        report = brain.report(run)
    finally:
        brain.close()
    assert report.job.status.value == "succeeded"
    sizes = [s for s in report.sizes if s.nodes == 2]
    assert len(sizes) == 1, report
    size = sizes[0]
    assert size.samples_per_s == pytest.approx(81.0)  # the median of the sums 81, 79, 81
    assert report.failures[FailureKind.OOM] == 1
    # The job's own min_round_s, kept with the run, and every round's length.
    assert report.min_round_s == config.brain.min_round_s == 60
    assert [(r.round, r.nodes) for r in report.rounds] == [(1, 2), (2, 1)]
    assert "none of the 2 rounds lasted that long" in render_text(report)
    assert report.plans[0].kind.value == "initial" and not report.plans[0].applied
    assert run == "demo-" + (config.work_dir / "brain-run").read_text().strip()


def test_a_restarted_master_continues_the_same_run(config) -> None:  # type: ignore[no-untyped-def]
    config.work_dir.mkdir(parents=True)
    first, second = BrainLink(config, "t"), BrainLink(config, "t")
    first.open()
    second.open()
    assert first.info is not None and second.info is not None
    assert first.info.name == second.info.name
    assert first.info.signature == second.info.signature == signature(config)
    first.close(None)
    second.close(None)


def test_a_brain_that_cannot_open_leaves_the_job_alone(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    config = parse_job_config(
        {"name": "demo", "command": "train.py",
         "brain": {"db": f"sqlite:///{tmp_path}/no/such/dir/brain.db"}},
        base_dir=tmp_path,
    )  # fmt: skip
    config.work_dir.mkdir(parents=True)
    link = BrainLink(config, "t")
    started = time.monotonic()
    link.open()
    assert not link.enabled and "brain unavailable" in link.last_plan
    assert link.poll_plan(1, None) is None and link.initial_nodes(3) == 3
    assert time.monotonic() - started < 5
    link.close(0)


def test_every_plan_is_counted_by_action_and_whether_it_was_carried_out(config) -> None:  # type: ignore[no-untyped-def]
    config.work_dir.mkdir(parents=True)
    tally = SupervisorTally()
    link = BrainLink(config, "t", tally)
    link.open()
    assert link.initial_nodes(2) == 2  # advise mode: an initial plan, as advice
    scale = Plan(
        PlanId(7), "demo", PlanKind.SCALE, "grow", {}, 1_795_000_000_000,
        current_nodes=2, target_nodes=3,
    )  # fmt: skip
    link.applied(scale, True)
    link.applied(scale, False, "not done: the job has ended")
    link.close(None)
    assert tally.plans == {("initial", False): 1, ("scale", True): 1, ("scale", False): 1}
    wire = tally.to_wire()
    assert [(p.action, p.applied, p.count) for p in wire.brain_plans] == [
        ("initial", False, 1), ("scale", False, 1), ("scale", True, 1),
    ]  # fmt: skip


def test_brain_mode_off_starts_the_configured_nodes_without_a_brain(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    config = parse_job_config(
        {"name": "demo", "command": "train.py", "brain": {"mode": "off"}}, base_dir=tmp_path
    )
    config.work_dir.mkdir(parents=True)
    link = BrainLink(config, "t")
    link.open()
    assert not link.enabled
    assert link.initial_nodes(3) == 3 and link.poll_plan(3, None) is None
    link.close(0)
