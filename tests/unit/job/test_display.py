"""The status block shows one line on in-memory checkpoints, only once there
is one (committed in memory, or persisted), and why a node failed its node
check."""

from __future__ import annotations

from dlfleet.api.v1 import checkpoint_pb2, job_pb2, nodecheck_pb2, rendezvous_pb2
from dlfleet.master.job.display import format_bytes, status_lines


def status(
    *,
    committed_step: int = -1,
    restorable_step: int = -1,
    bytes_held: int = 0,
    persisted_step: int = -1,
    replicated_step: int = -1,
) -> job_pb2.JobStatus:
    checkpoints = checkpoint_pb2.CheckpointStatus(
        committed_step=committed_step,
        restorable_step=restorable_step,
        bytes_held=bytes_held,
        persisted_step=persisted_step,
        replicated_step=replicated_step,
    )
    return job_pb2.JobStatus(job_name="j", phase="running", checkpoints=checkpoints)


def checkpoint_lines(job: job_pb2.JobStatus) -> list[str]:
    return [line.strip() for line in status_lines(job) if "checkpoints:" in line]


def test_the_checkpoint_line_shows_the_step_in_memory_and_the_persisted_step() -> None:
    job = status(committed_step=812, restorable_step=812, bytes_held=1288490189, persisted_step=800)
    assert checkpoint_lines(job) == [
        "checkpoints: step 812 in memory (1.2 GiB held), persisted step 800"
    ]
    job.checkpoints.replicated_step = 811
    assert checkpoint_lines(job) == [
        "checkpoints: step 812 in memory (1.2 GiB held, step 811 on two nodes), persisted step 800"
    ]


def test_a_committed_step_that_lost_its_copies_is_said_so() -> None:
    assert checkpoint_lines(status(committed_step=9)) == [
        "checkpoints: step 9 saved, no complete copy left in memory"
    ]


def test_no_checkpoint_line_without_a_checkpoint() -> None:
    assert checkpoint_lines(status()) == []
    assert checkpoint_lines(job_pb2.JobStatus(job_name="j", phase="running")) == []


def test_sizes_read_in_binary_units() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 5 << 20, 3 << 40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 MiB",
        "3.0 TiB",
    ]


def test_a_node_that_failed_its_node_check_says_why() -> None:
    verdict = nodecheck_pb2.NodeCheckVerdict(
        node_id="node-2#1", faulty=True, rule="compute_slow", reason="matmul 30.0 ms, 3.0x"
    )
    job = job_pb2.JobStatus(
        job_name="j", nodes=[job_pb2.NodeStatus(name="node-2", state="faulty", check=verdict)]
    )
    assert "  node-2: node check compute_slow: matmul 30.0 ms, 3.0x" in status_lines(job)


def failure_line(restarting: bool) -> str:
    failure = rendezvous_pb2.FailureReport(
        node_id="node-1#1", global_rank=1, exit_code=1, message="RuntimeError: boom",
        rule="diagnosis-off", category="unknown", action="restart", restarting=restarting,
    )  # fmt: skip
    job = job_pb2.JobStatus(job_name="j", phase="failed", last_failure=failure)
    (line,) = [line.strip() for line in status_lines(job) if "last failure" in line]
    return line


def test_a_failure_restarted_says_restart_and_one_that_ended_the_node_does_not() -> None:
    assert "rule diagnosis-off: restart)" in failure_line(restarting=True)
    ended = failure_line(restarting=False)
    assert "rule diagnosis-off: not restarted, restarts spent)" in ended, ended


def node_line(metrics: rendezvous_pb2.NodeMetrics) -> str:
    node = job_pb2.NodeStatus(name="node-0", state="running", metrics=metrics)
    job = job_pb2.JobStatus(job_name="j", phase="running", nodes=[node])
    (line,) = [line.strip() for line in status_lines(job) if line.strip().startswith("node-0:")]
    return line


def test_a_node_before_its_first_step_shows_no_pace_rather_than_zero() -> None:
    starting = node_line(rendezvous_pb2.NodeMetrics(cpu_percent=90, rss_bytes=300 << 20))
    assert starting == "node-0: no step yet | cpu 90% | rss 300 MiB"
    training = node_line(
        rendezvous_pb2.NodeMetrics(samples_per_second=512.0, step_time_ms=62.5, steps=40)
    )
    assert training.startswith("node-0: 512.0 samples/s | step 62 ms")


def test_a_running_job_shows_its_pace_and_an_ended_one_does_not() -> None:
    running = job_pb2.JobStatus(job_name="j", phase="running", samples_per_second=963.4)
    running.eta_seconds = 75
    assert "  963.4 samples/s | ETA 1m15s" in status_lines(running)
    ended = job_pb2.JobStatus(job_name="j", phase="succeeded", eta_seconds=-1)
    assert not [line for line in status_lines(ended) if "samples/s" in line or "ETA" in line]
