"""`BrainReporter`: metrics to the brain without ever making the caller wait.

The master calls `report_round`, `report_node_sample`, `report_failure` from
its event loop; they only append to a bounded queue under a lock that is
never held across I/O, so they take microseconds whether the brain is fast,
slow or down. When the queue is full the oldest record (or, by policy, the
newest) is dropped and counted. One background thread sends batches to the
`BrainApi`; a batch that fails is retried with exponential backoff and jitter
for at most `attempts` tries and `give_up_after_s` seconds, then dropped and
counted. Bad data (InvalidArgument) is dropped at once: a retry would fail the
same way. The job's info rides with the first batch, again after an update,
and again whenever the brain says it does not know the job.

`close(timeout_s)` flushes what is queued within the bound and drops the rest;
records reported after `close` are dropped and counted.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dlfleet.api.errors import DlfleetError, InvalidArgument, NotFound
from dlfleet.brain.api import BrainApi
from dlfleet.brain.records import (
    FailureRecord,
    JobInfo,
    MetricsBatch,
    NodeCheckRecord,
    NodeSample,
    RoundMetrics,
)

_log = logging.getLogger(__name__)

Record = RoundMetrics | NodeSample | FailureRecord | NodeCheckRecord


class Overflow(enum.Enum):
    DROP_OLDEST = "drop_oldest"
    DROP_NEWEST = "drop_newest"


@dataclass(frozen=True)
class ReporterSettings:
    capacity: int = 10_000  # records waiting to be sent
    batch_size: int = 500
    linger_s: float = 0.2  # how long a partial batch waits for more records
    attempts: int = 5  # per batch
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    give_up_after_s: float = 30.0  # per batch
    overflow: Overflow = Overflow.DROP_OLDEST

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.batch_size < 1 or self.attempts < 1:
            raise InvalidArgument("capacity, batch_size and attempts must be >= 1")

    def backoff(self, attempt: int) -> float:
        """Full jitter over an exponential cap."""
        return random.uniform(0, min(self.max_backoff_s, self.initial_backoff_s * 2**attempt))


@dataclass(frozen=True)
class ReporterStats:
    delivered: int  # records the brain has stored
    dropped: int  # records given up on, for any reason
    pending: int  # records queued or being sent
    dropped_overflow: int  # of `dropped`: pushed out of a full queue (or after close)
    failed_attempts: int  # deliveries that failed (each retry counts)
    last_error: str


class BrainReporter:
    def __init__(
        self,
        brain: BrainApi,
        job: JobInfo,
        settings: ReporterSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.brain = brain
        self.settings = settings or ReporterSettings()
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[Record] = deque()
        self._info = job
        self._info_version = 1
        self._info_sent = 0
        self._in_flight = 0
        self._delivered = 0
        self._dropped = 0
        self._dropped_overflow = 0
        self._failed_attempts = 0
        self._last_error = ""
        self._closing = False
        self._close_deadline = float("inf")
        self._wake = threading.Event()  # interrupts a backoff when closing
        self._thread = threading.Thread(target=self._run, name="brain-reporter", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- callers

    def report_round(self, metrics: RoundMetrics) -> None:
        self._put(metrics)

    def report_node_sample(self, sample: NodeSample) -> None:
        self._put(sample)

    def report_failure(self, failure: FailureRecord) -> None:
        self._put(failure)

    def report_node_check(self, check: NodeCheckRecord) -> None:
        self._put(check)

    def update_job(self, info: JobInfo) -> None:
        """New info for the job (its status at the end, say); sent with the next batch."""
        with self._cond:
            self._info = info
            self._info_version += 1
            self._cond.notify()

    def _put(self, record: Record) -> None:
        with self._cond:
            if self._closing:
                self._dropped += 1
                self._dropped_overflow += 1
                return
            if len(self._queue) >= self.settings.capacity:
                self._dropped += 1
                self._dropped_overflow += 1
                if self.settings.overflow is Overflow.DROP_NEWEST:
                    return
                self._queue.popleft()
            self._queue.append(record)
            if len(self._queue) == 1 or len(self._queue) >= self.settings.batch_size:
                self._cond.notify()

    def stats(self) -> ReporterStats:
        with self._cond:
            return ReporterStats(
                delivered=self._delivered,
                dropped=self._dropped,
                pending=len(self._queue) + self._in_flight,
                dropped_overflow=self._dropped_overflow,
                failed_attempts=self._failed_attempts,
                last_error=self._last_error,
            )

    def close(self, timeout_s: float = 5.0) -> ReporterStats:
        """Send what is queued, for at most `timeout_s`; drop what is left."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._close_deadline = self._clock() + timeout_s
            self._cond.notify()
        self._wake.set()
        self._thread.join(max(0.0, timeout_s) + 0.5)
        with self._cond:
            if self._queue:
                self._dropped += len(self._queue)
                self._queue.clear()
        return self.stats()

    # -------------------------------------------------------------- sender

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            self._deliver(*taken)

    def _take(self) -> tuple[list[Record], JobInfo | None, int] | None:
        """The next batch, after waiting for records (and lingering for a
        fuller batch); None when closed and nothing is left."""
        s = self.settings
        with self._cond:
            while not self._queue and self._info_sent == self._info_version:
                if self._closing:
                    return None
                self._cond.wait()
            if len(self._queue) < s.batch_size and not self._closing:
                self._cond.wait_for(
                    lambda: len(self._queue) >= s.batch_size or self._closing, s.linger_s
                )
            if self._closing and self._clock() >= self._close_deadline:
                return None
            count = min(len(self._queue), s.batch_size)
            records = [self._queue.popleft() for _ in range(count)]
            self._in_flight = count
            unsent = self._info_sent != self._info_version
            return records, (self._info if unsent else None), self._info_version

    def _deliver(self, records: list[Record], info: JobInfo | None, version: int) -> None:
        s = self.settings
        started = self._clock()
        for attempt in range(s.attempts):
            batch = MetricsBatch(
                job=self._info.name,
                info=info,
                rounds=[r for r in records if isinstance(r, RoundMetrics)],
                samples=[r for r in records if isinstance(r, NodeSample)],
                failures=[r for r in records if isinstance(r, FailureRecord)],
                node_checks=[r for r in records if isinstance(r, NodeCheckRecord)],
            )
            try:
                self.brain.persist(batch)
            except InvalidArgument as error:
                self._fail(f"refused: {error}")
                break
            except DlfleetError as error:
                self._fail(str(error))
                if isinstance(error, NotFound):  # the brain lost the job: register it again
                    info, version = self._current_info()
            except Exception as error:  # noqa: BLE001 - a bug in a brain must not end reporting
                _log.exception("brain reporter: persist raised")
                self._fail(f"{type(error).__name__}: {error}")
                break
            else:
                with self._cond:
                    self._delivered += len(records)
                    self._in_flight = 0
                    if info is not None:
                        self._info_sent = max(self._info_sent, version)
                return
            if not self._may_retry(attempt, started):
                break
        with self._cond:
            self._dropped += len(records)
            self._in_flight = 0
            if info is not None:  # given up on too; a NotFound later sends it again
                self._info_sent = max(self._info_sent, version)
        if records:
            _log.warning(
                "brain reporter: dropped %d records after %d attempt(s): %s",
                len(records),
                attempt + 1,
                self._last_error,
            )

    def _current_info(self) -> tuple[JobInfo, int]:
        with self._cond:
            return self._info, self._info_version

    def _fail(self, error: str) -> None:
        with self._cond:
            self._failed_attempts += 1
            self._last_error = error

    def _may_retry(self, attempt: int, started: float) -> bool:
        """Wait out the backoff before the next attempt; False when the batch's
        budget (tries, time, or the close deadline) is spent."""
        s = self.settings
        if attempt + 1 >= s.attempts:
            return False
        now = self._clock()
        with self._cond:
            deadline = min(started + s.give_up_after_s, self._close_deadline)
        pause = s.backoff(attempt)
        if now + pause >= deadline:
            return False
        self._wake.wait(pause)
        with self._cond:
            return self._clock() < min(started + s.give_up_after_s, self._close_deadline)
