"""`BrainReporter` never makes its caller wait, and counts what it loses."""

from __future__ import annotations

import threading
import time

from dlfleet.api.errors import InvalidArgument, NotFound, Unavailable
from dlfleet.brain.records import (
    FailureKind,
    FailureRecord,
    JobInfo,
    JobReport,
    MetricsBatch,
    NodeSample,
    Plan,
    PlanId,
    PlanRequest,
    RoundMetrics,
)
from dlfleet.brain.reporter import BrainReporter, Overflow, ReporterSettings

JOB = JobInfo(name="j", signature="s")
FAST = ReporterSettings(linger_s=0.01, initial_backoff_s=0.001, max_backoff_s=0.01)


class FakeBrain:
    """Stores batches; can be told to fail, to be slow, or to forget jobs."""

    def __init__(self) -> None:
        self.batches: list[MetricsBatch] = []
        self.failures_left = 0
        self.delay_s = 0.0
        self.known: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()

    def persist(self, batch: MetricsBatch) -> None:
        self.gate.wait()
        time.sleep(self.delay_s)
        if self.failures_left:
            self.failures_left -= 1
            raise Unavailable("brain down")
        if batch.info is not None:
            self.known.add(batch.info.name)
        if batch.job not in self.known:
            raise NotFound(f"no job {batch.job!r}")
        self.batches.append(batch)

    def plan(self, request: PlanRequest) -> Plan:
        raise NotImplementedError

    def mark_applied(self, plan_id: PlanId) -> Plan:
        raise NotImplementedError

    def report(self, job: str) -> JobReport:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def records(self) -> int:
        return sum(len(b) for b in self.batches)


def sample(i: int) -> NodeSample:
    return NodeSample("n", 1, i)


def test_everything_reported_is_delivered_in_batches_with_the_job_info_first() -> None:
    brain = FakeBrain()
    reporter = BrainReporter(brain, JOB, FAST)
    reporter.report_round(RoundMetrics(1, 1, 1, 0, 1, 1.0))
    for i in range(1000):
        reporter.report_node_sample(sample(i))
    reporter.report_failure(FailureRecord("n", FailureKind.CRASH, 5))
    stats = reporter.close(timeout_s=5)
    assert (stats.delivered, stats.dropped, stats.pending) == (1002, 0, 0)
    assert brain.records() == 1002
    assert brain.batches[0].info == JOB
    assert all(b.info is None for b in brain.batches[1:])
    assert max(len(b) for b in brain.batches) <= FAST.batch_size


def test_failures_are_retried_with_backoff() -> None:
    brain = FakeBrain()
    brain.failures_left = 2
    reporter = BrainReporter(brain, JOB, FAST)
    reporter.report_node_sample(sample(1))
    stats = reporter.close(timeout_s=5)
    assert (stats.delivered, stats.dropped, stats.failed_attempts) == (1, 0, 2)


def test_a_batch_that_keeps_failing_is_dropped_and_counted() -> None:
    brain = FakeBrain()
    brain.failures_left = 10**6
    reporter = BrainReporter(
        brain,
        JOB,
        ReporterSettings(linger_s=0.01, attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002),
    )
    for i in range(5):
        reporter.report_node_sample(sample(i))
    stats = reporter.close(timeout_s=5)
    assert (stats.delivered, stats.dropped, stats.pending) == (0, 5, 0)
    assert "brain down" in stats.last_error


def test_bad_data_is_dropped_at_once() -> None:
    class Refusing(FakeBrain):
        def persist(self, batch: MetricsBatch) -> None:
            raise InvalidArgument("bad round")

    reporter = BrainReporter(Refusing(), JOB, FAST)
    reporter.report_node_sample(sample(1))
    stats = reporter.close(timeout_s=5)
    assert (stats.dropped, stats.failed_attempts) == (1, 1)


def test_a_brain_that_forgot_the_job_gets_its_info_again() -> None:
    brain = FakeBrain()
    reporter = BrainReporter(brain, JOB, FAST)
    reporter.report_node_sample(sample(1))
    deadline = time.monotonic() + 5
    while reporter.stats().delivered < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    brain.known.clear()  # the brain's database was wiped
    reporter.report_node_sample(sample(2))
    stats = reporter.close(timeout_s=5)
    assert stats.delivered == 2
    assert brain.batches[-1].info == JOB


def test_a_stuck_brain_never_slows_the_caller_and_overflow_is_counted() -> None:
    brain = FakeBrain()
    brain.gate.clear()  # every persist blocks
    reporter = BrainReporter(
        brain, JOB, ReporterSettings(capacity=100, batch_size=10, linger_s=0.01)
    )
    took = []
    for i in range(5000):
        start = time.perf_counter()
        reporter.report_node_sample(sample(i))
        took.append(time.perf_counter() - start)
    # Microseconds each; the bound leaves room for a loaded CI machine, and is
    # still far below a single call to the stuck brain (forever).
    assert sum(took) < 0.5 and max(took) < 0.05
    stats = reporter.stats()
    assert stats.pending <= 100 + 10  # the queue, plus the batch in flight
    assert stats.dropped_overflow >= 5000 - 110
    stats = reporter.close(timeout_s=0.2)  # bounded even though the brain never answers
    assert stats.delivered == 0
    assert stats.dropped + stats.pending == 5000
    brain.gate.set()


def test_drop_newest_keeps_the_oldest_records() -> None:
    brain = FakeBrain()
    brain.gate.clear()
    reporter = BrainReporter(
        brain,
        JOB,
        ReporterSettings(capacity=3, batch_size=100, linger_s=10, overflow=Overflow.DROP_NEWEST),
    )
    for i in range(10):
        reporter.report_node_sample(sample(i))
    assert reporter.stats().dropped_overflow == 7
    brain.gate.set()
    reporter.close(timeout_s=5)
    assert [s.at_ms for b in brain.batches for s in b.samples] == [0, 1, 2]


def test_records_after_close_are_dropped_and_counted() -> None:
    reporter = BrainReporter(FakeBrain(), JOB, FAST)
    reporter.close(timeout_s=1)
    reporter.report_node_sample(sample(1))
    assert reporter.stats().dropped == 1


def test_a_job_update_is_sent_even_without_records() -> None:
    brain = FakeBrain()
    reporter = BrainReporter(brain, JOB, FAST)
    from dlfleet.brain.records import JobStatus

    done = JobInfo(name="j", signature="s", status=JobStatus.SUCCEEDED)
    reporter.update_job(done)
    reporter.close(timeout_s=5)
    assert brain.batches and brain.batches[-1].info == done
