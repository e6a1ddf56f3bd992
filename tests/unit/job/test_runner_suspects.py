"""The job's supervisor retires a node the master names as a network suspect
and starts a fresh one in its place, once per suspect, while relaunches last.

A real JobRunner over fakes (tests/fakes/job.py); the master's answer is
set by the test (tests/integration/master/test_rendezvous_service.py checks
that the master names suspects). The nodes have no processes: the suspect,
asked to leave, exits at the next poll and is then marked faulty; the
others finish at a poll the test names, which ends the job."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes.job import FakeMasterClient, FakePlatform, run_job

from dlfleet.api.v1 import job_pb2
from dlfleet.master.job.jobconfig import JobConfig, parse_job_config
from dlfleet.master.job.platform import NodeState


def job_config(tmp_path: Path, max_node_relaunches: int) -> JobConfig:
    (tmp_path / "train.py").write_text("")
    return parse_job_config(
        {
            "name": "suspects",
            "command": "train.py",
            "nodes": {"min": 2, "max": 2},
            "max_node_relaunches": max_node_relaunches,
            "brain": {"mode": "off"},
        },
        base_dir=tmp_path,
    )


@pytest.fixture
def platform(tmp_path: Path) -> FakePlatform:
    return FakePlatform(tmp_path / "logs")


def suspect(node_id: str) -> job_pb2.MasterStatus:
    return job_pb2.MasterStatus(
        network_suspects=[
            job_pb2.NetworkSuspect(node_id=node_id, rounds=[3, 5], reason="named it in rounds 3, 5")
        ]
    )


def test_a_network_suspect_is_retired_and_replaced_once(
    tmp_path: Path, platform: FakePlatform
) -> None:
    for name in ("node-0", "node-2"):
        platform.end(name, 0, at_poll=4)
    # The master names it at every answer: it is retired once.
    runner = run_job(job_config(tmp_path, 1), platform, FakeMasterClient(suspect("node-1#1")))
    nodes = platform.nodes
    assert [n.state for n in nodes] == [NodeState.SUCCEEDED, NodeState.FAULTY, NodeState.SUCCEEDED]
    assert nodes[1].detail == "network suspect: named it in rounds 3, 5"
    assert platform.stopped == ["node-1"] and nodes[2].name == "node-2"
    assert runner.state.relaunches_left == 0
    assert runner.state.result is not None and runner.state.result.code == 0


def test_without_a_relaunch_left_the_suspect_stays(tmp_path: Path, platform: FakePlatform) -> None:
    for name in ("node-0", "node-1"):
        platform.end(name, 0, at_poll=3)
    run_job(job_config(tmp_path, 0), platform, FakeMasterClient(suspect("node-0#1")))
    assert [n.state for n in platform.nodes] == [NodeState.SUCCEEDED] * 2
    assert platform.stopped == []


def test_a_suspect_that_is_no_longer_running_is_left_alone(
    tmp_path: Path, platform: FakePlatform
) -> None:
    platform.end("node-1", 0, at_poll=1)
    platform.end("node-0", 0, at_poll=3)
    # The master names node-1 only once it has finished.
    client = FakeMasterClient(job_pb2.MasterStatus(), suspect("node-1#1"))
    runner = run_job(job_config(tmp_path, 1), platform, client)
    assert len(platform.nodes) == 2 and platform.stopped == []
    assert runner.state.relaunches_left == 1
