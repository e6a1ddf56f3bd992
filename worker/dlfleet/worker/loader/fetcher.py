"""The loader's background thread: leases the next shard while the current one
trains, so the master round trip is hidden, and keeps held leases alive.

Invariants:
- A request goes out only while fewer than `refill_below` answers wait
  unconsumed: the thread leases ahead of the shard being cut into batches,
  never further than one request's answers beyond those. In sync mode a
  request asks for `shards_per_request` positions at once
  (`LeaseRequest.count`): every round trip costs both ranks' training threads
  GIL hand-offs and the master a durable write, so fewer, larger ones leave
  more of the steps to training. It goes out once half of the last answer's
  shards are taken, not when the last one is: the round trip then has half a
  request's steps to come back in (64 at the master's default shard), not one
  shard's (16), which a master busy with a durable write on a loaded machine
  can exceed, and the training thread would wait.
- The lease session is used from this thread only (LeaseSession is not
  thread-safe); renewals go through the thread-safe unary client.
- Acks ride on the next lease request (`done=`): a lease is acked only once
  the ledger says every record of it was trained by a completed step. A
  request that fails puts its acks back for the next one.
- Within an epoch, a round's next answer never waits for an ack, so asking one
  position ahead cannot deadlock. After END_OF_EPOCH the next request is sent
  only once every held lease is fully consumed: the master answers WAIT until
  the epoch's leases are DONE, and this request is what carries their acks.
- Every held lease is renewed every third of its time to live, with its
  consumed count; in sync mode a renewal refused because another rank already
  acked the lease is expected and ignored.
- In sync mode rank 0 also tells the master, every `progress_interval_s`,
  how far each held lease is trained (a renewal, for the leases that moved):
  the acks of a run of shards ride on a request that comes only once the run
  is taken (at the end of an epoch of a few runs), and the job's progress
  would stand still until then. The other ranks train the same records.
- A WAIT is retried after the master's `retry_after_ms`, at the same position.
- Any error ends the thread and is raised to the consumer on its next read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from dlfleet.api.client import (
    LeaseAnswer,
    LeaseSession,
    MasterClient,
    answers,
    rank_lease_request,
    round_lease_request,
)
from dlfleet.api.errors import StaleError
from dlfleet.api.v1 import shards_pb2
from dlfleet.worker.loader.environment import LoaderEnvironment, LoaderMode
from dlfleet.worker.loader.ledger import LeaseLedger

_log = logging.getLogger(__name__)

# Shards per sync-mode round trip: at the master's default shard (16 global
# batches) a round trip per 128 steps. Each round trip stalls the training
# thread for a few milliseconds while this thread holds the GIL (measured:
# 2-12 ms of rank 0's data wait at every round trip, 4 ms steps, 2 cores), so
# fewer is better. The shards stay separate leases, acked, renewed and
# requeued one by one, so this changes no failure's cost.
SHARDS_PER_REQUEST = 8
# How often sync rank 0 tells the master how far its leases are trained: the
# job's records done (its status, the dashboard) move this often.
PROGRESS_EVERY_S = 1.0


@dataclass(frozen=True)
class LeasedShard:
    lease_id: int
    epoch: int
    start: int
    end: int


@dataclass(frozen=True)
class EndOfEpoch:
    epoch: int


@dataclass(frozen=True)
class EndOfDataset:
    pass


Outcome = LeasedShard | EndOfEpoch | EndOfDataset


class LeaseFetcher:
    def __init__(
        self,
        client: MasterClient,
        ledger: LeaseLedger,
        dataset: str,
        env: LoaderEnvironment,
        mode: LoaderMode,
        *,
        refill_below: int | None = None,
        shards_per_request: int = SHARDS_PER_REQUEST,
        renew_interval_s: float | None = None,
        progress_interval_s: float = PROGRESS_EVERY_S,
    ) -> None:
        self._client = client
        self._ledger = ledger
        self._dataset = dataset
        self._env = env
        self._mode = mode
        self._count = shards_per_request if mode is LoaderMode.SYNC else 1
        self._refill_below = refill_below or max(1, self._count // 2)
        self._renew_interval_s = renew_interval_s
        self._cond = threading.Condition()
        self._results: deque[Outcome | BaseException] = deque()
        self._position = 0
        self._after_epoch = False
        self._finished = False
        self._stopping = False
        self._last_renew = time.monotonic()
        reports = mode is LoaderMode.SYNC and env.rank == 0
        self._progress_interval_s = progress_interval_s if reports else None
        self._last_progress = time.monotonic()
        self._told: dict[int, int] = {}  # lease id -> consumed, as the master last heard
        self._thread = threading.Thread(
            target=self._run, name=f"dlfleet-lease-{dataset}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def next_outcome(self) -> Outcome:
        """The next answer, in order; raises the error that ended the thread."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._results))
            item = self._results.popleft()
            # The thread waits for room only (see _may_ask): waking it for
            # every shard taken would cost the training thread GIL hand-offs.
            if len(self._results) < self._refill_below:
                self._cond.notify_all()
        if isinstance(item, BaseException):
            with self._cond:
                self._results.appendleft(item)  # every later read fails the same way
            raise item
        return item

    def poke(self) -> None:
        """The ledger changed: a held lease may now be ready to ack. Only a
        thread waiting out the end of an epoch waits on the ledger (acks
        otherwise ride on the next request), so only that one is woken: a
        wake-up costs the training thread a GIL hand-off. No wake-up is lost:
        the thread reads the ledger after it sets `_after_epoch`."""
        with self._cond:
            if self._after_epoch:
                self._cond.notify_all()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------- thread

    def _may_ask(self) -> bool:
        if self._finished or len(self._results) >= self._refill_below:
            return False
        return not self._after_epoch or self._ledger.all_complete()

    def _run(self) -> None:
        try:
            with self._client.lease_session() as session:
                self._loop(session)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, who raises it
            with self._cond:
                self._results.append(error)
                self._finished = True
                self._cond.notify_all()

    def _loop(self, session: LeaseSession) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._may_ask(), self._renew_wait())
                if self._stopping:
                    return
                ask = self._may_ask()
            self._renew_if_due()
            if not ask:
                continue
            done = self._ledger.take_ready()
            try:
                answer = self._ask(session, done)
            except BaseException:
                self._ledger.retry(done)
                raise
            self._ledger.confirm(done)
            if isinstance(answer, answers.Wait):
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping, answer.retry_after_ms / 1000)
                continue
            outcome, more = self._taken(answer)
            with self._cond:
                self._position += 1 + len(more)
                self._after_epoch = isinstance(outcome, EndOfEpoch)
                self._finished = isinstance(outcome, EndOfDataset)
                self._results.append(outcome)
                self._results.extend(more)
                self._cond.notify_all()
            if self._finished:
                return

    def _ask(self, session: LeaseSession, done: list[int]) -> LeaseAnswer:
        if self._mode is LoaderMode.SYNC:
            return session.ask(
                round_lease_request(
                    self._dataset, self._env.round, self._position, done, self._count
                )
            )
        return session.ask(
            rank_lease_request(self._dataset, self._env.node_id, self._env.rank, done, None)
        )

    def _taken(
        self, answer: answers.Leased | answers.EndOfEpoch | answers.EndOfDataset
    ) -> tuple[Outcome, list[LeasedShard]]:
        """What the consumer gets from an answer: its outcome, and the shards
        leased with it for the positions after."""
        if isinstance(answer, answers.Leased):
            return self._leased(answer.shard), [self._leased(shard) for shard in answer.more]
        if isinstance(answer, answers.EndOfEpoch):
            return EndOfEpoch(answer.epoch), []
        return EndOfDataset(), []

    def _leased(self, shard: shards_pb2.Shard) -> LeasedShard:
        self._ledger.add(shard.lease_id, shard.end - shard.start, shard.epoch, shard.start)
        if self._renew_interval_s is None:
            # A third of the lease's time to live, measured on its first lease.
            ttl_s = shard.deadline_unix_ms / 1000 - time.time()
            self._renew_interval_s = max(0.2, ttl_s / 3)
        return LeasedShard(shard.lease_id, shard.epoch, shard.start, shard.end)

    def _renew_wait(self) -> float | None:
        if self._renew_interval_s is None:
            return None  # no lease yet
        due = self._last_renew + self._renew_interval_s
        if self._progress_interval_s is not None:
            due = min(due, self._last_progress + self._progress_interval_s)
        return max(0.0, due - time.monotonic())

    def _renew_if_due(self) -> None:
        """Extend every held lease when due, telling the master how far it is
        trained; between those, tell it the progress of the leases that moved."""
        if self._renew_interval_s is None:
            return
        now = time.monotonic()
        renew_all = now >= self._last_renew + self._renew_interval_s
        progress = (
            self._progress_interval_s is not None
            and now >= self._last_progress + self._progress_interval_s
        )
        if not (renew_all or progress):
            return
        if renew_all:
            self._last_renew = now
        self._last_progress = now
        round_ = self._env.round if self._mode is LoaderMode.SYNC else 0
        told: dict[int, int] = {}
        for lease_id, consumed in self._ledger.held():
            told[lease_id] = heard = self._told.get(lease_id, 0)
            if not renew_all and consumed <= heard:
                continue
            try:
                self._client.renew(self._dataset, lease_id, consumed, round=round_)
                told[lease_id] = consumed
            except StaleError as error:
                # Another rank of the round may have acked it already. If it
                # was lost instead, its ack fails loudly on the next request.
                _log.debug("not renewing lease %d: %s", lease_id, error)
        self._told = told
