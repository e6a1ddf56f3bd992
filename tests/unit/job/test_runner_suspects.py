"""The job's supervisor retires a node the master names as a network suspect
and starts a fresh one in its place, once per suspect, while relaunches last.

A real JobRunner and a real LocalPlatform; the master's answer is set
directly (tests/integration/master/test_rendezvous_service.py checks that the
master names suspects). The nodes are created without processes (a launch
far in the future, marked running): the suspect is stopped and retired at
once. The fresh node's agent is a real process, pointed at no master; it is
killed at the end."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlfleet.api.v1 import job_pb2
from dlfleet.master.job.display import PlainDisplay
from dlfleet.master.job.jobconfig import parse_job_config
from dlfleet.master.job.platform import NodeState
from dlfleet.master.job.platform.local import LocalPlatform
from dlfleet.master.job.runner import JobRunner


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[JobRunner]:
    (tmp_path / "train.py").write_text("")
    config = parse_job_config(
        {
            "name": "suspects",
            "command": "train.py",
            "nodes": {"min": 2, "max": 2},
            "max_node_relaunches": 1,
            "env": {"DLFLEET_CONNECT_BUDGET": "1"},
        },
        base_dir=tmp_path,
    )
    made = JobRunner(config, PlainDisplay(io.StringIO()))
    platform = LocalPlatform(config, master="127.0.0.1:1", token="t")
    made.platform = platform
    for _ in range(2):
        platform.add_node(delay_s=3600).state = NodeState.RUNNING
    yield made
    for node in platform.nodes:
        if node.proc is not None:
            node.proc.kill()
            node.proc.wait(10)


def suspect(node_id: str) -> job_pb2.MasterStatus:
    return job_pb2.MasterStatus(
        network_suspects=[
            job_pb2.NetworkSuspect(node_id=node_id, rounds=[3, 5], reason="named it in rounds 3, 5")
        ]
    )


def test_a_network_suspect_is_retired_and_replaced_once(runner: JobRunner) -> None:
    assert runner.platform is not None
    runner.view = suspect("node-1#1")
    runner._note_suspects()
    nodes = runner.platform.nodes
    assert [n.state for n in nodes[:2]] == [NodeState.RUNNING, NodeState.FAULTY]
    assert nodes[1].detail == "network suspect: named it in rounds 3, 5"
    assert len(nodes) == 3 and nodes[2].name == "node-2" and nodes[2].proc is not None
    assert runner.relaunches_left == 0
    runner._note_suspects()  # the same answer again: nothing more
    assert len(runner.platform.nodes) == 3


def test_without_a_relaunch_left_the_suspect_stays(runner: JobRunner) -> None:
    assert runner.platform is not None
    runner.relaunches_left = 0
    runner.view = suspect("node-0#1")
    runner._note_suspects()
    assert [n.state for n in runner.platform.nodes] == [NodeState.RUNNING] * 2


def test_a_suspect_that_is_no_longer_running_is_left_alone(runner: JobRunner) -> None:
    assert runner.platform is not None
    runner.platform.nodes[1].state = NodeState.LOST
    runner.view = suspect("node-1#1")
    runner._note_suspects()
    assert len(runner.platform.nodes) == 2 and runner.relaunches_left == 1
