"""The shard core: per-epoch TODO -> DOING -> DONE leases over dataset positions.

Invariants (checked by tests/unit/core/test_shards_properties.py):
- Every position of the current epoch is in exactly one of TODO (requeued head
  or fresh), DOING (the unconsumed part of a live lease), DONE, or FAILED.
- A rejected call (bad input, stale lease, stale round) raises before any event
  is applied: it changes nothing.
- A lease is counted DONE once; a repeated report of it is a harmless duplicate.
- DONE only grows within an epoch, except through an explicit restore.
- Expiry, holder death and a closed round return the unconsumed remainder to the
  head of TODO without counting against the shard; explicit failures count, and
  a shard that fails `max_shard_failures` times is FAILED, listed in status.

Two kinds of consumer: a `RankConsumer` (async mode: its own leases) and a
`RoundConsumer` (sync mode: position k of round r has one answer for every
rank, so all ranks see the same shards and the same end of epoch).

Every operation validates first, then applies events (see events.py); the same
`apply` replays the journal after a restart. Time is the `now_ms` argument.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from dlfleet.api.errors import InvalidArgument, NotFound, StaleError
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.events import (
    ConsumerAnswered,
    DatasetRegistered,
    EpochCompleted,
    Event,
    LeaseDone,
    LeaseGranted,
    LeaseReleased,
    LeaseRenewed,
    Restored,
    RoundAdvanced,
    ShardFailed,
)
from dlfleet.master.core.intervals import IntervalSet, Range
from dlfleet.master.settings import STANDALONE

END_OF_EPOCH = "end_of_epoch"
END_OF_DATASET = "end_of_dataset"
# The most positions one `lease_run` answers: a request's work and answer stay
# small whatever count a client sends.
MAX_LEASE_RUN = 64


@dataclass(frozen=True)
class ShardSettings:
    lease_timeout_ms: int = STANDALONE.lease_timeout_ms
    wait_retry_ms: int = 200


@dataclass(frozen=True)
class RankConsumer:
    node_id: str
    rank: int

    @property
    def key(self) -> str:
        return f"rank:{self.node_id}:{self.rank}"


@dataclass(frozen=True)
class RoundConsumer:
    round: int
    position: int

    @property
    def key(self) -> str:
        return f"round:{self.round}"


Consumer = RankConsumer | RoundConsumer


class Answer(Enum):
    SHARD = "shard"
    END_OF_EPOCH = END_OF_EPOCH
    WAIT = "wait"
    END_OF_DATASET = END_OF_DATASET


@dataclass
class Lease:
    lease_id: int
    epoch: int
    shard: int
    start: int
    end: int
    consumed: int
    deadline_ms: int
    consumer: str
    node_id: str
    round: int
    position: int
    request_id: str

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardLease:
    """What a consumer gets: the wire's (dataset, epoch, start, end, lease, deadline)."""

    dataset: str
    epoch: int
    start: int
    end: int
    lease_id: int
    deadline_ms: int
    round: int


@dataclass(frozen=True)
class LeaseOutcome:
    answer: Answer
    shard: ShardLease | None = None
    epoch: int = 0
    retry_after_ms: int = 0


@dataclass(frozen=True)
class FailedRange:
    epoch: int
    start: int
    end: int
    failures: int
    reason: str


@dataclass(frozen=True)
class Snapshot:
    """Compact progress: goes into model checkpoints."""

    dataset: str
    spec_digest: str
    epoch: int
    done: tuple[Range, ...]
    failed: tuple[FailedRange, ...]
    finished: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "spec_digest": self.spec_digest,
            "epoch": self.epoch,
            "done": [list(r) for r in self.done],
            "failed": [[f.epoch, f.start, f.end, f.failures, f.reason] for f in self.failed],
            "finished": self.finished,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Snapshot:
        return cls(
            dataset=data["dataset"],
            spec_digest=data["spec_digest"],
            epoch=data["epoch"],
            done=tuple((int(s), int(e)) for s, e in data["done"]),
            failed=tuple(FailedRange(*f) for f in data["failed"]),
            finished=data["finished"],
        )

    def digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()[:16]


@dataclass(frozen=True)
class DatasetStatusView:
    config: DatasetConfig
    epoch: int
    finished: bool
    records_per_epoch: int
    records_done: int
    records_doing: int  # the untrained rest of the live leases
    records_todo: int
    leases_active: int
    failed: tuple[FailedRange, ...]
    shards_done: int = 0  # shards of the epoch every record of which is DONE
    # The trained prefix of the live leases, as their renewals last said:
    # DONE as soon as a lease is released, and trained already.
    records_consumed: int = 0

    @property
    def records_trained(self) -> int:
        """Records trained in all epochs so far: the epochs before this one,
        this one's DONE, and what the live leases have trained. It moves
        with training, not only as leases are acked (at an epoch's end, when
        a request asks for a run of shards at once)."""
        if self.finished:
            return self.records_per_epoch * self.config.epochs
        return self.records_per_epoch * self.epoch + self.records_done + self.records_consumed


def whole_shards(done: IntervalSet, config: DatasetConfig) -> int:
    """How many of the epoch's shards `done` covers entirely: a few steps per
    range of `done`, which merging keeps near the shards in flight."""
    size, length = config.shard_size, config.epoch_length
    count = 0
    for start, end in done:
        first = -(-start // size)  # the first shard that begins inside the range
        past = config.shards_per_epoch if end >= length else end // size
        count += max(0, past - first)
    return count


@dataclass
class ConsumerState:
    cursor: int  # the epoch this consumer is in
    last_request_id: str = ""
    last_lease_id: int = 0


@dataclass
class DatasetState:
    config: DatasetConfig
    epoch: int = 0
    round: int = 0
    requeued: deque[tuple[int, int, int]] = field(default_factory=deque)
    fresh: IntervalSet = field(default_factory=IntervalSet)
    done: IntervalSet = field(default_factory=IntervalSet)
    doing: dict[int, Lease] = field(default_factory=dict)
    failure_counts: dict[int, int] = field(default_factory=dict)
    failed: list[FailedRange] = field(default_factory=list)
    # Ids of leases DONE in this epoch and the last, for duplicate reports. Ids
    # are handed out in order, so these merge into a few ranges.
    done_leases: IntervalSet = field(default_factory=IntervalSet)
    prev_done_leases: IntervalSet = field(default_factory=IntervalSet)
    positions: dict[int, tuple[str, int]] = field(default_factory=dict)
    next_position: int = 0
    consumers: dict[str, ConsumerState] = field(default_factory=dict)
    restore_key: str = ""
    max_lease_id: int = 0

    @property
    def finished(self) -> bool:
        return self.epoch >= self.config.epochs

    def has_todo(self) -> bool:
        return bool(self.requeued) or bool(self.fresh)

    def peek_todo(self) -> tuple[int, int, int]:
        """The head of TODO as (shard, start, end): requeued remainders first,
        then the next fresh shard, cut at shard boundaries."""
        if self.requeued:
            return self.requeued[0]
        first = self.fresh.first()
        assert first is not None, "peek_todo on an empty TODO"
        start = first[0]
        shard = self.config.shard_of(start)
        return shard, start, min(first[1], self.config.shard_end(shard))

    def todo_total(self) -> int:
        return sum(e - s for _, s, e in self.requeued) + self.fresh.total()

    def epoch_complete(self) -> bool:
        return not self.finished and not self.doing and not self.has_todo()


class ShardBook:
    """All datasets of one job. Not thread-safe: one owner drives it."""

    def __init__(self, settings: ShardSettings | None = None) -> None:
        self.settings = settings or ShardSettings()
        self.datasets: dict[str, DatasetState] = {}
        self._next_lease_id = 1
        self._deadlines: list[tuple[int, int, str]] = []
        self._appliers: dict[type[Event], Callable[[Any], None]] = {
            DatasetRegistered: self._apply_registered,
            RoundAdvanced: self._apply_round,
            LeaseGranted: self._apply_granted,
            LeaseRenewed: self._apply_renewed,
            LeaseDone: self._apply_done,
            LeaseReleased: self._apply_released,
            ShardFailed: self._apply_failed,
            ConsumerAnswered: self._apply_answered,
            EpochCompleted: self._apply_epoch_completed,
            Restored: self._apply_restored,
        }

    # ----------------------------------------------------------- operations

    def register(self, config: DatasetConfig) -> tuple[bool, list[Event]]:
        """Idempotent: an identical config again is (False, []); a different one
        under the same name is InvalidArgument."""
        existing = self.datasets.get(config.name)
        if existing is not None:
            if existing.config != config:
                raise InvalidArgument(
                    f"dataset {config.name!r} is already registered with a different "
                    f"spec: {_spec_diff(existing.config, config)}"
                )
            return False, []
        events: list[Event] = []
        self._emit(events, DatasetRegistered(config.name, config.to_dict()))
        return True, events

    def lease(
        self,
        dataset: str,
        consumer: Consumer,
        now_ms: int,
        request_id: str = "",
        done: Sequence[int] = (),
    ) -> tuple[LeaseOutcome, list[Event]]:
        """The next answer for `consumer`, after reporting the leases in `done`
        as finished (validated first: a stale one rejects the whole call)."""
        ds = self._dataset(dataset)
        events: list[Event] = []
        position = -1
        replay: LeaseOutcome | None = None
        round_ = 0
        if isinstance(consumer, RoundConsumer):
            position, round_ = consumer.position, consumer.round
            replay = self._check_round_position(ds, consumer)
        elif consumer.rank < 0 or not consumer.node_id:
            raise InvalidArgument(f"rank consumer needs a node id and a rank >= 0: {consumer}")
        finished = self._live_unreported(ds, done, round_, now_ms)
        for lease_id in finished:
            self._emit(events, LeaseDone(dataset, lease_id))
            self._complete_epoch_if_due(ds, events)
        if replay is not None:
            return replay, events
        if round_ > ds.round:
            self._advance_round(ds, round_, events)

        key = consumer.key
        state = ds.consumers.get(key)
        if request_id and state is not None and state.last_request_id == request_id:
            lease = ds.doing.get(state.last_lease_id)
            if lease is not None:
                return self._shard_outcome(ds, lease), events
        cursor = state.cursor if state is not None else ds.epoch

        if cursor < ds.epoch:
            self._emit(
                events, ConsumerAnswered(dataset, key, position, END_OF_EPOCH, cursor, ds.epoch)
            )
            return LeaseOutcome(Answer.END_OF_EPOCH, epoch=cursor), events
        if ds.finished:
            if position >= 0:
                self._emit(
                    events,
                    ConsumerAnswered(dataset, key, position, END_OF_DATASET, ds.epoch, cursor),
                )
            return LeaseOutcome(Answer.END_OF_DATASET, epoch=ds.epoch), events
        if ds.has_todo():
            shard, start, end = ds.peek_todo()
            node_id = consumer.node_id if isinstance(consumer, RankConsumer) else ""
            round_ = consumer.round if isinstance(consumer, RoundConsumer) else 0
            granted = LeaseGranted(
                dataset, self._next_lease_id, shard, start, end,
                now_ms + self.settings.lease_timeout_ms, key, node_id, round_, position, request_id,
            )  # fmt: skip
            self._emit(events, granted)
            return self._shard_outcome(ds, ds.doing[granted.lease_id]), events
        if cursor == ds.epoch:
            self._emit(
                events,
                ConsumerAnswered(dataset, key, position, END_OF_EPOCH, ds.epoch, ds.epoch + 1),
            )
            return LeaseOutcome(Answer.END_OF_EPOCH, epoch=ds.epoch), events
        return LeaseOutcome(Answer.WAIT, retry_after_ms=self.settings.wait_retry_ms), events

    def lease_run(
        self,
        dataset: str,
        consumer: RoundConsumer,
        count: int,
        now_ms: int,
        done: Sequence[int] = (),
    ) -> tuple[list[LeaseOutcome], list[Event]]:
        """Up to `count` consecutive positions of a round at once: the answer
        at `consumer.position` (as `lease`), then, while that is a shard, the
        shards at the next positions. The run stops before the first position
        whose answer would not be a shard: that one is decided only when asked
        for alone, so no END_OF_EPOCH, WAIT or error is ever decided without
        being delivered, and each position keeps one answer for every rank.
        At most MAX_LEASE_RUN positions."""
        outcome, events = self.lease(dataset, consumer, now_ms, "", done)
        outcomes = [outcome]
        ds = self._dataset(dataset)
        position = consumer.position
        while outcome.answer is Answer.SHARD and len(outcomes) < min(count, MAX_LEASE_RUN):
            position += 1
            following = RoundConsumer(consumer.round, position)
            if not self._answers_shard(ds, following):
                break
            outcome, more = self.lease(dataset, following, now_ms)
            assert outcome.answer is Answer.SHARD, f"position {position}: {outcome}"
            events += more
            outcomes.append(outcome)
        return outcomes, events

    def renew(
        self, dataset: str, lease_id: int, round_: int, consumed: int, now_ms: int
    ) -> tuple[int, list[Event]]:
        """Record progress and extend the deadline; returns the new deadline."""
        ds = self._dataset(dataset)
        lease = self._live_lease(ds, lease_id, round_, now_ms)
        self._check_consumed(lease, consumed)
        deadline = max(lease.deadline_ms, now_ms + self.settings.lease_timeout_ms)
        events: list[Event] = []
        self._emit(events, LeaseRenewed(dataset, lease_id, max(consumed, lease.consumed), deadline))
        return deadline, events

    def report_done(
        self, dataset: str, lease_id: int, round_: int, now_ms: int
    ) -> tuple[bool, list[Event]]:
        """Returns (duplicate, events): a lease already counted DONE is a
        harmless duplicate, so a retried report is safe."""
        ds = self._dataset(dataset)
        if not self._live_unreported(ds, (lease_id,), round_, now_ms):
            return True, []
        events: list[Event] = []
        self._emit(events, LeaseDone(dataset, lease_id))
        self._complete_epoch_if_due(ds, events)
        return False, events

    def report_failure(
        self, dataset: str, lease_id: int, round_: int, consumed: int, reason: str, now_ms: int
    ) -> list[Event]:
        ds = self._dataset(dataset)
        lease = self._live_lease(ds, lease_id, round_, now_ms)
        self._check_consumed(lease, consumed)
        events: list[Event] = []
        self._emit(
            events, ShardFailed(dataset, lease_id, max(consumed, lease.consumed), reason[:500])
        )
        self._complete_epoch_if_due(ds, events)
        return events

    def snapshot(
        self, dataset: str, round_: int, progress: Iterable[tuple[int, int]], now_ms: int
    ) -> tuple[Snapshot, list[Event]]:
        """The dataset's progress, after applying the caller's exact progress on
        its leases (as of the checkpointed step)."""
        ds = self._dataset(dataset)
        self._check_round(ds, round_)
        updates: list[tuple[Lease, int]] = []
        for lease_id, consumed in progress:
            if lease_id in ds.done_leases or lease_id in ds.prev_done_leases:
                continue
            lease = self._live_lease(ds, lease_id, round_, now_ms)
            self._check_consumed(lease, consumed)
            updates.append((lease, consumed))
        events: list[Event] = []
        for lease, consumed in updates:
            if consumed > lease.consumed:
                self._emit(
                    events, LeaseRenewed(dataset, lease.lease_id, consumed, lease.deadline_ms)
                )
        return self._snapshot_of(ds), events

    def restore(self, snapshot: Snapshot, round_: int, now_ms: int) -> tuple[bool, list[Event]]:
        """Put the dataset back to exactly `snapshot`; every live lease becomes
        stale. Within a round (round > 0) it is idempotent per snapshot, so
        every rank of the round may call it; without a round it always applies,
        so a job can roll back to the same checkpoint twice."""
        del now_ms  # restore does not depend on time; kept for a uniform API
        ds = self._dataset(snapshot.dataset)
        self._check_round(ds, round_)
        _validate_snapshot(ds.config, snapshot)
        key = f"{round_}:{snapshot.digest()}"
        if round_ > 0 and key == ds.restore_key:
            return False, []
        events: list[Event] = []
        if round_ > ds.round:
            self._advance_round(ds, round_, events)
        self._emit(events, Restored(snapshot.dataset, snapshot.to_dict(), key))
        self._complete_epoch_if_due(ds, events)
        return True, events

    def begin_round(self, round_: int) -> list[Event]:
        """Make `round_` current on every dataset: older rounds' leases are
        released (not counted) and their requests become stale."""
        events: list[Event] = []
        for ds in self.datasets.values():
            if round_ > ds.round:
                self._advance_round(ds, round_, events)
        return events

    def expire(self, now_ms: int) -> list[Event]:
        """Release every lease whose deadline has passed."""
        events: list[Event] = []
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, lease_id, name = heapq.heappop(self._deadlines)
            ds = self.datasets.get(name)
            lease = ds.doing.get(lease_id) if ds is not None else None
            if ds is not None and lease is not None and lease.deadline_ms <= now_ms:
                self._emit(events, LeaseReleased(name, lease_id, lease.consumed, "expired"))
                self._complete_epoch_if_due(ds, events)
        return events

    def release_node(self, node_id: str) -> list[Event]:
        """The node died: release the leases its ranks held."""
        events: list[Event] = []
        for name, ds in self.datasets.items():
            held = [lease for lease in ds.doing.values() if lease.node_id == node_id]
            for lease in held:
                self._emit(
                    events, LeaseReleased(name, lease.lease_id, lease.consumed, "holder_died")
                )
            if held:
                self._complete_epoch_if_due(ds, events)
        return events

    def rearm(self, now_ms: int) -> list[Event]:
        """After a master restart: give every live lease a full timeout, so the
        master's downtime does not expire leases whose holders kept working."""
        events: list[Event] = []
        deadline = now_ms + self.settings.lease_timeout_ms
        for name, ds in self.datasets.items():
            for lease in list(ds.doing.values()):
                if lease.deadline_ms < deadline:
                    self._emit(events, LeaseRenewed(name, lease.lease_id, lease.consumed, deadline))
        return events

    def status(self, dataset: str) -> DatasetStatusView:
        ds = self._dataset(dataset)
        consumed = sum(lease.consumed for lease in ds.doing.values())
        doing = sum(lease.length for lease in ds.doing.values()) - consumed
        done = ds.done.total()
        return DatasetStatusView(
            config=ds.config,
            epoch=ds.epoch,
            finished=ds.finished,
            records_per_epoch=ds.config.epoch_length,
            records_done=done,
            records_doing=doing,
            records_todo=ds.todo_total(),
            leases_active=len(ds.doing),
            failed=tuple(ds.failed),
            shards_done=whole_shards(ds.done, ds.config),
            records_consumed=consumed,
        )

    def install(self, state: DatasetState) -> None:
        """Adopt a dataset's state from a checkpoint (recovery), then replay the
        journal entries after it with `apply`."""
        self.datasets[state.config.name] = state
        self._next_lease_id = max(self._next_lease_id, state.max_lease_id + 1)
        for lease in state.doing.values():
            heapq.heappush(self._deadlines, (lease.deadline_ms, lease.lease_id, state.config.name))

    def lease_ids_for(self, dataset: str) -> list[int]:
        return sorted(self._dataset(dataset).doing)

    # --------------------------------------------------------------- apply

    def apply(self, event: Event) -> None:
        self._appliers[type(event)](event)

    def _emit(self, events: list[Event], event: Event) -> None:
        """Apply `event` as soon as it is decided, and keep it for the
        journal. An operation decides in steps that read what the step before
        changed (a lease run grants one lease after another, an ack may end
        the epoch), so it applies as it goes rather than deciding on a copy;
        `apply` is still the only way state changes, and the events the whole
        of it: the master writes them in one append, and replay applies them
        with the same `apply`."""
        self.apply(event)
        events.append(event)

    def _apply_registered(self, event: DatasetRegistered) -> None:
        config = DatasetConfig.from_dict(event.config)
        state = DatasetState(config=config)
        state.fresh.add(0, config.epoch_length)
        self.datasets[config.name] = state

    def _apply_round(self, event: RoundAdvanced) -> None:
        ds = self.datasets[event.dataset]
        ds.round = event.round
        ds.positions.clear()
        ds.next_position = 0
        for key in [k for k in ds.consumers if k.startswith("round:")]:
            del ds.consumers[key]

    def _apply_granted(self, event: LeaseGranted) -> None:
        ds = self.datasets[event.dataset]
        head = ds.peek_todo()
        if head != (event.shard, event.start, event.end):
            raise AssertionError(f"journal diverged: grant {event} but TODO head is {head}")
        if ds.requeued:
            ds.requeued.popleft()
        else:
            ds.fresh.remove(event.start, event.end)
        ds.doing[event.lease_id] = Lease(
            event.lease_id, ds.epoch, event.shard, event.start, event.end, 0,
            event.deadline_ms, event.consumer, event.node_id, event.round, event.position,
            event.request_id,
        )  # fmt: skip
        ds.max_lease_id = max(ds.max_lease_id, event.lease_id)
        self._next_lease_id = max(self._next_lease_id, event.lease_id + 1)
        heapq.heappush(self._deadlines, (event.deadline_ms, event.lease_id, event.dataset))
        state = ds.consumers.setdefault(event.consumer, ConsumerState(cursor=ds.epoch))
        state.last_request_id = event.request_id
        state.last_lease_id = event.lease_id
        if event.position >= 0:
            ds.positions[event.position] = ("lease", event.lease_id)
            ds.next_position = event.position + 1

    def _apply_renewed(self, event: LeaseRenewed) -> None:
        lease = self.datasets[event.dataset].doing[event.lease_id]
        lease.consumed = event.consumed
        if event.deadline_ms != lease.deadline_ms:
            lease.deadline_ms = event.deadline_ms
            heapq.heappush(self._deadlines, (event.deadline_ms, event.lease_id, event.dataset))

    def _apply_done(self, event: LeaseDone) -> None:
        ds = self.datasets[event.dataset]
        lease = ds.doing.pop(event.lease_id)
        ds.done.add(lease.start, lease.end)
        ds.done_leases.add(lease.lease_id, lease.lease_id + 1)

    def _apply_released(self, event: LeaseReleased) -> None:
        ds = self.datasets[event.dataset]
        lease = ds.doing.pop(event.lease_id)
        cut = lease.start + event.consumed
        ds.done.add(lease.start, cut)
        if cut < lease.end:
            ds.requeued.appendleft((lease.shard, cut, lease.end))

    def _apply_failed(self, event: ShardFailed) -> None:
        ds = self.datasets[event.dataset]
        lease = ds.doing.pop(event.lease_id)
        cut = lease.start + event.consumed
        ds.done.add(lease.start, cut)
        if cut >= lease.end:
            return
        count = ds.failure_counts.get(lease.shard, 0) + 1
        ds.failure_counts[lease.shard] = count
        if count >= ds.config.max_shard_failures:
            ds.failed.append(FailedRange(ds.epoch, cut, lease.end, count, event.reason))
        else:
            ds.requeued.appendleft((lease.shard, cut, lease.end))

    def _apply_answered(self, event: ConsumerAnswered) -> None:
        ds = self.datasets[event.dataset]
        ds.consumers.setdefault(
            event.consumer, ConsumerState(cursor=ds.epoch)
        ).cursor = event.cursor
        if event.position >= 0:
            ds.positions[event.position] = (event.answer, event.epoch)
            ds.next_position = event.position + 1

    def _apply_epoch_completed(self, event: EpochCompleted) -> None:
        ds = self.datasets[event.dataset]
        ds.epoch = event.epoch + 1
        ds.done = IntervalSet()
        ds.requeued.clear()
        ds.fresh = IntervalSet()
        if not ds.finished:
            ds.fresh.add(0, ds.config.epoch_length)
        ds.failure_counts.clear()
        ds.prev_done_leases = ds.done_leases
        ds.done_leases = IntervalSet()

    def _apply_restored(self, event: Restored) -> None:
        ds = self.datasets[event.dataset]
        snap = Snapshot.from_dict(event.snapshot)
        ds.epoch = snap.epoch
        ds.doing.clear()
        ds.done = IntervalSet(snap.done)
        ds.failed = list(snap.failed)
        ds.failure_counts = {}
        blocked = IntervalSet(snap.done)
        for failed in snap.failed:
            if failed.epoch == snap.epoch:
                blocked.add(failed.start, failed.end)
                shard = ds.config.shard_of(failed.start)
                ds.failure_counts[shard] = failed.failures
        ds.requeued.clear()
        ds.fresh = IntervalSet()
        if not ds.finished:
            ds.fresh = blocked.complement(0, ds.config.epoch_length)
        ds.positions.clear()
        ds.consumers.clear()
        ds.done_leases = IntervalSet()
        ds.prev_done_leases = IntervalSet()
        ds.restore_key = event.restore_key

    # ------------------------------------------------------------- helpers

    def _dataset(self, name: str) -> DatasetState:
        ds = self.datasets.get(name)
        if ds is None:
            raise NotFound(f"dataset {name!r} is not registered")
        return ds

    def _check_round(self, ds: DatasetState, round_: int) -> None:
        if round_ < 0:
            raise InvalidArgument(f"round must be >= 0, got {round_}")
        if 0 < round_ < ds.round:
            raise StaleError(
                f"round {round_} is stale: dataset {ds.config.name!r} serves round {ds.round}"
            )

    def _check_round_position(
        self, ds: DatasetState, consumer: RoundConsumer
    ) -> LeaseOutcome | None:
        """Validate a round consumer; an already answered position is replayed."""
        if consumer.round < 1:
            raise InvalidArgument(f"a round consumer needs round >= 1, got {consumer.round}")
        if consumer.position < 0:
            raise InvalidArgument(f"position must be >= 0, got {consumer.position}")
        self._check_round(ds, consumer.round)
        next_position = ds.next_position if consumer.round == ds.round else 0
        if consumer.position > next_position:
            raise InvalidArgument(
                f"position {consumer.position} of round {consumer.round} skips ahead: "
                f"the next position is {next_position}"
            )
        if consumer.position == next_position:
            return None
        entry = ds.positions.get(consumer.position)
        if entry is None:
            raise StaleError(
                f"position {consumer.position} of round {consumer.round} was invalidated "
                "by a restore"
            )
        kind, value = entry
        if kind == END_OF_EPOCH:
            return LeaseOutcome(Answer.END_OF_EPOCH, epoch=value)
        if kind == END_OF_DATASET:
            return LeaseOutcome(Answer.END_OF_DATASET, epoch=value)
        lease = ds.doing.get(value)
        if lease is None:
            raise StaleError(
                f"lease {value} at position {consumer.position} of round {consumer.round} "
                "is no longer live"
            )
        return self._shard_outcome(ds, lease)

    def _answers_shard(self, ds: DatasetState, consumer: RoundConsumer) -> bool:
        """Whether `lease` (no request id, nothing done) would answer a shard
        at this position, without deciding anything: `lease`'s own checks,
        read-only. False wherever `lease` would raise."""
        if consumer.round != ds.round or consumer.position < 0:
            return False
        if consumer.position < ds.next_position:
            entry = ds.positions.get(consumer.position)
            return entry is not None and entry[0] == "lease" and entry[1] in ds.doing
        if consumer.position > ds.next_position:
            return False
        state = ds.consumers.get(consumer.key)
        cursor = state.cursor if state is not None else ds.epoch
        return cursor >= ds.epoch and not ds.finished and ds.has_todo()

    def _live_unreported(
        self, ds: DatasetState, lease_ids: Iterable[int], round_: int, now_ms: int
    ) -> list[int]:
        """The leases of `lease_ids` to mark DONE now: each must be live (or
        already DONE, a duplicate that is skipped); raises on any other."""
        finished: list[int] = []
        for lease_id in lease_ids:
            if lease_id not in ds.doing and (
                lease_id in ds.done_leases or lease_id in ds.prev_done_leases
            ):
                continue
            self._live_lease(ds, lease_id, round_, now_ms)
            if lease_id not in finished:
                finished.append(lease_id)
        return finished

    def _live_lease(self, ds: DatasetState, lease_id: int, round_: int, now_ms: int) -> Lease:
        lease = ds.doing.get(lease_id)
        if lease is None:
            raise StaleError(
                f"lease {lease_id} of dataset {ds.config.name!r} is not live "
                "(expired, released, restored over, or never granted)"
            )
        if lease.round != round_:
            raise StaleError(f"lease {lease_id} belongs to round {lease.round}, not {round_}")
        if lease.deadline_ms <= now_ms:
            raise StaleError(f"lease {lease_id} expired at {lease.deadline_ms} (now {now_ms})")
        return lease

    @staticmethod
    def _check_consumed(lease: Lease, consumed: int) -> None:
        if not 0 <= consumed <= lease.length:
            raise InvalidArgument(
                f"consumed {consumed} is outside 0..{lease.length} for lease {lease.lease_id}"
            )

    def _advance_round(self, ds: DatasetState, round_: int, events: list[Event]) -> None:
        name = ds.config.name
        for lease in [lease for lease in ds.doing.values() if lease.round]:
            self._emit(events, LeaseReleased(name, lease.lease_id, lease.consumed, "round_closed"))
        self._emit(events, RoundAdvanced(name, round_))
        self._complete_epoch_if_due(ds, events)

    def _complete_epoch_if_due(self, ds: DatasetState, events: list[Event]) -> None:
        if ds.epoch_complete():
            self._emit(events, EpochCompleted(ds.config.name, ds.epoch))

    def _shard_outcome(self, ds: DatasetState, lease: Lease) -> LeaseOutcome:
        shard = ShardLease(
            dataset=ds.config.name,
            epoch=lease.epoch,
            start=lease.start,
            end=lease.end,
            lease_id=lease.lease_id,
            deadline_ms=lease.deadline_ms,
            round=lease.round,
        )
        return LeaseOutcome(Answer.SHARD, shard=shard, epoch=lease.epoch)

    def _snapshot_of(self, ds: DatasetState) -> Snapshot:
        done = IntervalSet(ds.done)
        for lease in ds.doing.values():
            done.add(lease.start, lease.start + lease.consumed)
        epoch = ds.epoch
        covered = IntervalSet(done)
        for failed in ds.failed:
            if failed.epoch == epoch:
                covered.add(failed.start, failed.end)
        if not ds.finished and covered.covers(0, ds.config.epoch_length):
            # Canonical form: a fully trained epoch is the start of the next one,
            # so that snapshot -> restore -> snapshot is the identity.
            epoch, done = epoch + 1, IntervalSet()
        return Snapshot(
            dataset=ds.config.name,
            spec_digest=ds.config.digest(),
            epoch=epoch,
            done=tuple(done),
            failed=tuple(ds.failed),
            finished=epoch >= ds.config.epochs,
        )


def _spec_diff(old: DatasetConfig, new: DatasetConfig) -> str:
    a, b = old.to_dict(), new.to_dict()
    return ", ".join(f"{k}={b[k]!r} (registered: {a[k]!r})" for k in a if a[k] != b[k])


def _validate_snapshot(config: DatasetConfig, snap: Snapshot) -> None:
    where = f"snapshot of dataset {snap.dataset!r}"
    if snap.spec_digest != config.digest():
        raise InvalidArgument(
            f"{where} was taken with a different dataset spec "
            f"(digest {snap.spec_digest!r}, registered {config.digest()!r})"
        )
    if snap.finished != (snap.epoch >= config.epochs):
        raise InvalidArgument(f"{where}: finished={snap.finished} contradicts epoch {snap.epoch}")
    if not 0 <= snap.epoch <= config.epochs:
        raise InvalidArgument(f"{where}: epoch {snap.epoch} outside 0..{config.epochs}")
    length = config.epoch_length
    cursor = 0
    for start, end in snap.done:
        if not cursor <= start < end <= length:
            raise InvalidArgument(
                f"{where}: done ranges must be sorted, disjoint and within [0, {length}); "
                f"got {list(snap.done)}"
            )
        cursor = end
    done = IntervalSet(snap.done)
    for failed in snap.failed:
        if not (0 <= failed.epoch <= snap.epoch and 0 <= failed.start < failed.end <= length):
            raise InvalidArgument(f"{where}: bad failed range {failed}")
        if failed.epoch == snap.epoch and done.overlaps(failed.start, failed.end):
            raise InvalidArgument(f"{where}: failed range {failed} overlaps done ranges")
