"""The job's samples/s in its supervisor's status is what its nodes train
now (the sum of their latest rates, as the master's own status sums them),
from the first report on: not records done over a window of 15 s, which in
a short job counted the start-up (half the rate at the end of a job of 8 s
of training) and stood at zero while the master heard of no ack. The ETA
follows from it.

A real JobRunner over fakes (tests/fakes/job.py): two nodes with no
processes that finish at the third poll, and a master that gives the
answer the test sets. The first status the runner shows is read."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes.job import FakeMasterClient, FakePlatform, RecordingDisplay, run_job

from dlfleet.api.status_document import samples_per_second
from dlfleet.api.v1 import job_pb2, rendezvous_pb2
from dlfleet.master.job.jobconfig import JobConfig, parse_job_config


@pytest.fixture
def config(tmp_path: Path) -> JobConfig:
    (tmp_path / "train.py").write_text("")
    return parse_job_config(
        {
            "name": "rates",
            "command": "train.py",
            "nodes": {"min": 2, "max": 2},
            "brain": {"mode": "off"},
        },
        base_dir=tmp_path,
    )


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


def first_status(config: JobConfig, view: job_pb2.MasterStatus) -> job_pb2.JobStatus:
    platform = FakePlatform(config.work_dir / "logs")
    for name in ("node-0", "node-1"):
        platform.end(name, 0, at_poll=3)
    display = RecordingDisplay()
    run_job(config, platform, FakeMasterClient(view), display)
    return display.statuses[0]


def test_the_jobs_rate_is_the_sum_of_its_nodes_from_the_first_report(config: JobConfig) -> None:
    status = first_status(config, master_view(4096, {"node-0#1": 480.0, "node-1#1": 520.0}))
    assert [n.metrics.samples_per_second for n in status.nodes] == [480.0, 520.0]
    assert status.samples_per_second == pytest.approx(1000.0)
    assert status.eta_seconds == pytest.approx(4096 / 1000.0)


def test_a_job_whose_nodes_report_no_rate_has_no_eta(config: JobConfig) -> None:
    status = first_status(config, master_view(0, {}))
    assert status.samples_per_second == 0.0 and status.eta_seconds == -1


def test_the_sum_counts_only_nodes_with_metrics() -> None:
    nodes = [
        job_pb2.NodeStatus(name="a", metrics=rendezvous_pb2.NodeMetrics(samples_per_second=2.5)),
        job_pb2.NodeStatus(name="b"),
    ]
    assert samples_per_second(nodes) == 2.5


def test_a_job_with_every_record_done_has_nothing_left_to_wait_for(config: JobConfig) -> None:
    assert first_status(config, master_view(8192, {})).eta_seconds == 0


def test_the_masters_goodput_ledger_is_in_the_supervisors_status(config: JobConfig) -> None:
    view = master_view(4096, {"node-0#1": 480.0})
    view.goodput.CopyFrom(
        job_pb2.Goodput(
            ratio=0.9,
            window_seconds=100.0,
            productive_seconds=90.0,
            badput=[job_pb2.Badput(cause="restart", seconds=10.0)],
        )
    )
    status = first_status(config, view)
    assert status.goodput == view.goodput
