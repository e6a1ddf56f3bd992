"""The job's samples/s in its supervisor's status is what its nodes train
now (the sum of their latest rates, as the master's own status sums them),
from the first report on: not records done over a window of 15 s, which in
a short job counted the start-up (half the rate at the end of a job of 8 s
of training) and stood at zero while the master heard of no ack. The ETA
follows from it.

A real JobRunner with nodes that have no processes (a launch far in the
future, marked running); the master's answer is set directly."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlfleet.api.status_document import samples_per_second
from dlfleet.api.v1 import job_pb2, rendezvous_pb2
from dlfleet.master.job.display import PlainDisplay
from dlfleet.master.job.jobconfig import parse_job_config
from dlfleet.master.job.platform import NodeState
from dlfleet.master.job.platform.local import LocalPlatform
from dlfleet.master.job.runner import JobRunner


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[JobRunner]:
    (tmp_path / "train.py").write_text("")
    config = parse_job_config(
        {"name": "rates", "command": "train.py", "nodes": {"min": 2, "max": 2}},
        base_dir=tmp_path,
    )
    made = JobRunner(config, PlainDisplay(io.StringIO()))
    made.platform = LocalPlatform(config, master="127.0.0.1:1", token="t")
    for _ in range(2):
        made.platform.add_node(delay_s=3600).state = NodeState.RUNNING
    yield made


def master_view(done: int, rates: dict[str, float]) -> job_pb2.MasterStatus:
    return job_pb2.MasterStatus(
        datasets=[job_pb2.DatasetProgress(name="d", records_done=done, records_total=8192)],
        nodes=[
            job_pb2.NodeReport(
                node_id=node_id, metrics=rendezvous_pb2.NodeMetrics(samples_per_second=rate)
            )
            for node_id, rate in rates.items()
        ],
    )


def test_the_jobs_rate_is_the_sum_of_its_nodes_from_the_first_report(runner: JobRunner) -> None:
    runner.view = master_view(4096, {"node-0#1": 480.0, "node-1#1": 520.0})
    status = runner.status()
    assert [n.metrics.samples_per_second for n in status.nodes] == [480.0, 520.0]
    assert status.samples_per_second == pytest.approx(1000.0)
    assert status.eta_seconds == pytest.approx(4096 / 1000.0)


def test_a_job_whose_nodes_report_no_rate_has_no_eta(runner: JobRunner) -> None:
    runner.view = master_view(0, {})
    status = runner.status()
    assert status.samples_per_second == 0.0 and status.eta_seconds == -1


def test_the_sum_counts_only_nodes_with_metrics() -> None:
    nodes = [
        job_pb2.NodeStatus(name="a", metrics=rendezvous_pb2.NodeMetrics(samples_per_second=2.5)),
        job_pb2.NodeStatus(name="b"),
    ]
    assert samples_per_second(nodes) == 2.5


def test_a_job_with_every_record_done_has_nothing_left_to_wait_for(runner: JobRunner) -> None:
    runner.view = master_view(8192, {})
    assert runner.status().eta_seconds == 0
