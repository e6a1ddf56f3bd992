"""A job run for a DLFleetJob (the controller's master Pod): the runner
writes the job's figures into the resource's status (`resource_link.fields`)
and scales when the resource's spec.nodes changes. Over the fakes of
tests/fakes/job.py, the link included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fakes.job import FakeMasterClient, FakePlatform, FakeResourceLink, run_job

from dlfleet.api.v1 import job_pb2, rendezvous_pb2
from dlfleet.master.job import runner as runner_module
from dlfleet.master.job.jobconfig import JobConfig, parse_job_config
from dlfleet.master.job.platform.resource_link import fields, wanted


def job_config(tmp_path: Path, **settings: Any) -> JobConfig:
    (tmp_path / "train.py").write_text("")
    return parse_job_config(
        {
            "name": "linked",
            "command": "train.py",
            "nodes": {"min": 1, "max": 3, "initial": 2},
            "brain": {"mode": "off"},
            **settings,
        },
        base_dir=tmp_path,
    )


def formed(round_: int = 1) -> job_pb2.MasterStatus:
    return job_pb2.MasterStatus(
        round=round_,
        world_size=2,
        datasets=[job_pb2.DatasetProgress(name="d", records_total=100, records_done=40)],
    )


def test_the_status_says_running_with_the_nodes_round_and_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "LINK_S", 0.0)
    platform = FakePlatform(tmp_path / "logs")
    for name in ("node-0", "node-1"):
        platform.end(name, 0, at_poll=5)
    link = FakeResourceLink(2)
    run_job(job_config(tmp_path), platform, FakeMasterClient(formed()), link=link)
    running = [p for p in link.published if p.get("phase") == "Running"]
    assert running, link.published
    assert running[0]["nodes"] == "2/1/3" and running[0]["readyNodes"] == 2
    assert running[0]["round"] == 1 and running[0]["recordsDone"] == 40
    assert platform.added == [("node-0", 0.0), ("node-1", 0.0)]  # no scaling asked


def test_a_change_of_spec_nodes_scales_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "LINK_S", 0.0)
    platform = FakePlatform(tmp_path / "logs")
    for name in ("node-0", "node-1", "node-2"):
        platform.end(name, 0, at_poll=8)
    link = FakeResourceLink(2, 2, 3)  # the spec asks for 3 at the third look
    runner = run_job(job_config(tmp_path), platform, FakeMasterClient(formed()), link=link)
    assert [name for name, _ in platform.added] == ["node-0", "node-1", "node-2"]
    assert runner.state.target == 3


def test_a_spec_beyond_nodes_max_is_refused_and_the_job_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "LINK_S", 0.0)
    platform = FakePlatform(tmp_path / "logs")
    for name in ("node-0", "node-1"):
        platform.end(name, 0, at_poll=6)
    link = FakeResourceLink(2, 9)
    runner = run_job(job_config(tmp_path), platform, FakeMasterClient(formed()), link=link)
    assert len(platform.added) == 2 and runner.state.target == 2
    assert runner.state.result is not None and runner.state.result.code == 0


def test_fields_before_a_round_and_with_goodput() -> None:
    status = job_pb2.JobStatus(master_up=True, round=0)
    assert "phase" not in fields(status, 1, 2)  # the controller's Created stands
    status = job_pb2.JobStatus(master_up=False, round=3, world_size=0)
    assert fields(status, 1, 2)["phase"] == "Restarting"
    status = job_pb2.JobStatus(master_up=True, round=0, world_size=0)  # round 3 closed
    assert fields(status, 1, 2, last_round=3)["phase"] == "Restarting"
    assert fields(status, 1, 2, last_round=3)["round"] == 3
    status = job_pb2.JobStatus(master_up=True, round=3, world_size=2)
    status.goodput.window_seconds = 10.0
    status.goodput.ratio = 0.98123
    out = fields(status, 1, 2)
    assert out["phase"] == "Running" and out["goodput"] == "0.981"


def test_the_nodes_a_spec_asks_for() -> None:
    assert wanted({"nodes": {"min": 2, "max": 4, "initial": 3}}) == 3
    assert wanted({"nodes": {"min": 2}}) == 2
    assert wanted({}) is None


def test_a_lost_node_a_worker_failure_and_the_end_are_events_on_the_resource(
    tmp_path: Path,
) -> None:
    platform = FakePlatform(tmp_path / "logs")
    platform.end("node-1", 3, at_poll=2)
    platform.end("node-0", 0, at_poll=4)
    platform.end("node-1", 0, at_poll=5)
    failed = formed()
    report = rendezvous_pb2.FailureReport(
        node_id="node-0#1", round=1, local_rank=0, exit_code=-9, signal="SIGKILL",
        message="killed\nmore lines", restart_count=0, restarting=True,
        category="transient", rule="signal-kill",
    )  # fmt: skip
    failed.failures.append(report)
    link = FakeResourceLink(2)
    run_job(
        job_config(tmp_path, max_node_relaunches=2),
        platform,
        FakeMasterClient(formed(), failed),
        link=link,
    )
    assert link.events == [
        (
            True,
            "WorkerFailed",
            "node-0 local rank 0 failed (signal SIGKILL) in round 1: restarting "
            "(transient, rule signal-kill): killed",
        ),
        (True, "NodeLost", "node-1 was lost (exit code 3): relaunching it in 2.0s "
         "(1 relaunches left)"),
        (False, "Succeeded", "job linked succeeded: every node's workers finished"),
    ]  # fmt: skip


def test_a_job_run_from_job_yaml_records_no_events(tmp_path: Path) -> None:
    platform = FakePlatform(tmp_path / "logs")
    platform.end("node-1", 3, at_poll=2)
    platform.end("node-0", 0, at_poll=4)
    platform.end("node-1", 0, at_poll=5)
    runner = run_job(job_config(tmp_path, max_node_relaunches=2), platform)
    assert runner.link is None and runner._events == []


def test_a_change_of_phase_is_written_at_once_between_the_periodic_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "LINK_S", 3600.0)  # one periodic write: the first
    platform = FakePlatform(tmp_path / "logs")
    for name in ("node-0", "node-1"):
        platform.end(name, 0, at_poll=8)
    closed = job_pb2.MasterStatus()  # no round: the next one forming
    views = [formed(1), formed(1), closed, closed, formed(2)]
    link = FakeResourceLink(2)
    run_job(job_config(tmp_path), platform, FakeMasterClient(*views), link=link)
    phases = [p.get("phase") for p in link.published]
    assert phases[:3] == ["Running", "Restarting", "Running"], link.published
