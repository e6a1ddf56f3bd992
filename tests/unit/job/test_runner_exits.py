"""What the job's supervisor does when a node exits, as the user reads it:
the policy's answer (tests/unit/job/test_policy.py) carried out on the
platform, in the words of the log and of the job's result.

A real JobRunner over fakes (tests/fakes/job.py): two nodes with no
processes, exits scheduled by poll, a master with nothing to say. The same
words from real dlworker processes: tests/integration/job/test_job_runner.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fakes.job import FakePlatform, run_job

from dlfleet.master.job.jobconfig import JobConfig, parse_job_config
from dlfleet.master.job.platform import EXIT_PREEMPTED, REASON_OOM, NodeState
from dlfleet.master.job.runner import JobRunner


def job_config(tmp_path: Path, **settings: Any) -> JobConfig:
    (tmp_path / "train.py").write_text("")
    return parse_job_config(
        {
            "name": "exits",
            "command": "train.py",
            "nodes": {"min": 1, "max": 2},
            "relaunch_delay_s": 0.5,
            "brain": {"mode": "off"},
            **settings,
        },
        base_dir=tmp_path,
    )


@pytest.fixture
def platform(tmp_path: Path) -> FakePlatform:
    return FakePlatform(tmp_path / "logs")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def result_of(runner: JobRunner) -> tuple[int, str]:
    assert runner.state.result is not None
    return runner.state.result.code, runner.state.result.reason


def test_every_node_finishing_succeeds_the_job(tmp_path: Path, platform: FakePlatform) -> None:
    platform.end("node-0", 0, at_poll=1)
    platform.end("node-1", 0, at_poll=2)
    runner = run_job(job_config(tmp_path), platform)
    assert result_of(runner) == (0, "every node's workers finished")
    assert [n.state for n in platform.nodes] == [NodeState.SUCCEEDED] * 2
    assert platform.shut_down


def test_a_lost_node_is_relaunched_after_the_delay(
    tmp_path: Path, platform: FakePlatform, caplog: pytest.LogCaptureFixture
) -> None:
    platform.end("node-1", 3, at_poll=1)
    platform.end("node-0", 0, at_poll=2)
    platform.end("node-1", 0, at_poll=3)
    runner = run_job(job_config(tmp_path, max_node_relaunches=2), platform)
    assert platform.relaunched == [("node-1", 0.5, None)]
    assert "node-1 was lost (exit code 3): relaunching it in 0.5s (1 relaunches left)" in (
        warnings(caplog)
    )
    assert runner.state.relaunches_left == 1 and runner.tally.node_relaunches == 1
    assert result_of(runner)[0] == 0


def test_a_node_lost_three_times_is_replaced_by_a_fresh_one(
    tmp_path: Path, platform: FakePlatform, caplog: pytest.LogCaptureFixture
) -> None:
    for poll in (1, 2, 3):
        platform.end("node-1", -9, at_poll=poll)
    platform.end("node-0", 0, at_poll=4)
    platform.end("node-2", 0, at_poll=4)
    run_job(job_config(tmp_path, max_node_relaunches=5), platform)
    assert [r[0] for r in platform.relaunched] == ["node-1", "node-1"]
    assert platform.added[-1] == ("node-2", 0.5)
    assert platform.nodes[1].state is NodeState.FAULTY
    assert (
        "node-1 was lost 3 times (last: killed by SIGKILL): marked faulty, replaced by node-2 "
        "(2 relaunches left)"
    ) in warnings(caplog)


def test_a_worker_killed_for_memory_is_relaunched_as_out_of_memory(
    tmp_path: Path, platform: FakePlatform, caplog: pytest.LogCaptureFixture
) -> None:
    platform.end("node-1", 5, at_poll=1)
    platform.end("node-0", 0, at_poll=2)
    platform.end("node-1", 0, at_poll=2)
    run_job(job_config(tmp_path), platform)
    assert (
        "node-1 was lost (a worker was killed for memory (its agent's diagnosis)): "
        "relaunching it in 0.5s (2 relaunches left)"
    ) in warnings(caplog)


def test_a_node_with_a_hardware_fault_is_replaced_at_once(
    tmp_path: Path, platform: FakePlatform, caplog: pytest.LogCaptureFixture
) -> None:
    platform.end("node-1", 4, at_poll=1)
    platform.end("node-0", 0, at_poll=2)
    platform.end("node-2", 0, at_poll=2)
    run_job(job_config(tmp_path), platform)
    assert platform.added[-1] == ("node-2", 0.0) and platform.relaunched == []
    assert (
        "node-1: its agent diagnosed a hardware fault: marked faulty, replaced at once by "
        "node-2 (2 relaunches left)"
    ) in warnings(caplog)


def test_a_failed_node_check_with_no_relaunch_left_goes_on_without_the_node(
    tmp_path: Path, platform: FakePlatform, caplog: pytest.LogCaptureFixture
) -> None:
    platform.end("node-1", 6, at_poll=1)
    platform.end("node-0", 0, at_poll=2)
    runner = run_job(job_config(tmp_path, max_node_relaunches=0), platform)
    assert (
        "node-1: failed its pre-flight node check: marked faulty; going on with 1 nodes"
    ) in warnings(caplog)
    assert result_of(runner)[0] == 0


def test_a_lost_node_with_no_relaunch_left_below_min_fails_the_job(
    tmp_path: Path, platform: FakePlatform
) -> None:
    platform.end("node-1", EXIT_PREEMPTED, at_poll=1)
    config = job_config(tmp_path, nodes={"min": 2, "max": 2}, max_node_relaunches=0)
    runner = run_job(config, platform)
    assert result_of(runner) == (
        1,
        "node-1 was lost (exit code 143, SIGTERM) and no relaunch is left "
        "(max_node_relaunches=0); 1 nodes remain, fewer than nodes.min=2",
    )


def test_a_node_check_failure_below_min_fails_the_job_naming_the_check(
    tmp_path: Path, platform: FakePlatform
) -> None:
    platform.end("node-0", 6, at_poll=1)
    config = job_config(tmp_path, nodes={"min": 2, "max": 2}, max_node_relaunches=0)
    assert result_of(run_job(config, platform)) == (
        1,
        "node-0: failed its pre-flight node check, and no relaunch is left to replace it "
        "(max_node_relaunches=0); 1 nodes remain, fewer than nodes.min=2",
    )


def test_failed_training_fails_the_job_pointing_at_the_nodes_log(
    tmp_path: Path, platform: FakePlatform
) -> None:
    platform.end("node-1", 1, at_poll=1)
    runner = run_job(job_config(tmp_path), platform)
    log = tmp_path / "logs" / "node-1.log"
    assert result_of(runner) == (1, f"node-1: its workers failed (exit code 1); see {log}")
    assert platform.nodes[1].state is NodeState.FAILED


def test_a_dlworker_that_refused_its_flags_fails_the_job(
    tmp_path: Path, platform: FakePlatform
) -> None:
    platform.end("node-0", 2, at_poll=1)
    runner = run_job(job_config(tmp_path), platform)
    log = tmp_path / "logs" / "node-0.log"
    assert result_of(runner) == (1, f"node-0: dlworker ended with exit code 2; see {log}")


def test_an_evicted_out_of_memory_pod_is_a_loss_whatever_its_code(
    tmp_path: Path, platform: FakePlatform, caplog: pytest.LogCaptureFixture
) -> None:
    platform.end("node-1", 1, REASON_OOM, at_poll=1)
    platform.end("node-0", 0, at_poll=2)
    platform.end("node-1", 0, at_poll=2)
    run_job(job_config(tmp_path), platform)
    assert platform.relaunched == [("node-1", 0.5, None)]  # no limit to grow
    assert (
        "node-1 was lost (killed: out of memory (OOMKilled)): relaunching it in 0.5s "
        "(2 relaunches left)"
    ) in warnings(caplog)
