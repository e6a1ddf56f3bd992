"""Property-based tests of the shard core: a hypothesis state machine drives a
ShardBook with random consumers, renewals, reports, failures, expiries, node
deaths, round changes, snapshots and restores, and checks the invariants of
`dlfleet.master.core.shards` after every step, against a ledger of what the
"model lineage" trained."""

from __future__ import annotations

from collections import Counter
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from dlfleet.api.errors import DlfleetError, InvalidArgument, StaleError
from dlfleet.master.core.codec import dump_dataset, load_dataset
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.events import Event
from dlfleet.master.core.shards import (
    Answer,
    RankConsumer,
    RoundConsumer,
    ShardBook,
    ShardSettings,
    Snapshot,
)

NAME = "ds"
TIMEOUT = 100


class ShardBookMachine(RuleBasedStateMachine):
    leases = Bundle("leases")
    snapshots = Bundle("snapshots")

    def __init__(self) -> None:
        super().__init__()
        self.book = ShardBook(ShardSettings(lease_timeout_ms=TIMEOUT, wait_retry_ms=5))
        self.journal: list[str] = []
        self.now = 0
        self.round = 1
        self.position = 0
        self.last_done: dict[str, Any] | None = None
        self.failures: Counter[tuple[int, int]] = Counter()

    @initialize(
        size=st.integers(1, 40),
        batch=st.integers(1, 8),
        shard=st.integers(0, 12),
        epochs=st.integers(1, 3),
        failures=st.integers(1, 3),
        drop_last=st.booleans(),
    )
    def register(
        self, size: int, batch: int, shard: int, epochs: int, failures: int, drop_last: bool
    ) -> None:
        config = DatasetConfig.create(
            name=NAME,
            size=size,
            batch_size=min(batch, size),
            shard_size=shard,
            epochs=epochs,
            seed=7,
            drop_last=drop_last,
            max_shard_failures=failures,
        )
        created, events = self.book.register(config)
        assert created
        self._record(events)
        assert self.book.register(config) == (False, [])

    # ------------------------------------------------------------ helpers

    def _record(self, events: list[Event]) -> None:
        for event in events:
            self.journal.append(event.to_json())

    def _state(self) -> dict[str, Any]:
        return dump_dataset(self.book.datasets[NAME])

    def _rejected(self, call: Any) -> None:
        """A call that must be rejected, and must change nothing."""
        before = self._state()
        try:
            call()
        except (StaleError, InvalidArgument):
            pass
        else:
            raise AssertionError("call was expected to be rejected")
        assert self._state() == before

    def _try(self, call: Any) -> Any:
        """A call that may be legitimately rejected; if so, nothing changes."""
        before = self._state()
        try:
            result = call()
        except DlfleetError:
            assert self._state() == before
            return None
        return result

    # ------------------------------------------------------------- rules

    @rule(target=leases, node=st.sampled_from(["a", "b", "c"]), rank=st.integers(0, 1))
    def lease_rank(self, node: str, rank: int) -> Any:
        outcome, events = self.book.lease(NAME, RankConsumer(node, rank), self.now)
        self._record(events)
        if outcome.answer is Answer.SHARD:
            assert outcome.shard is not None
            return (outcome.shard.lease_id, 0, outcome.shard.end - outcome.shard.start)
        return (-1, 0, 0)

    @rule(target=leases, held=consumes(leases), node=st.sampled_from(["a", "b"]))
    def lease_rank_reporting_done(self, held: tuple[int, int, int], node: str) -> Any:
        """The next lease with the last one's DONE piggybacked: all or nothing."""
        result = self._try(
            lambda: self.book.lease(NAME, RankConsumer(node, 0), self.now, done=[held[0]])
        )
        if result is None:
            return (-1, 0, 0)
        outcome, events = result
        self._record(events)
        if held[0] >= 0 and held[1] == 0:
            assert self.book.report_done(NAME, held[0], 0, self.now) == (True, [])
        if outcome.answer is Answer.SHARD:
            assert outcome.shard is not None
            return (outcome.shard.lease_id, 0, outcome.shard.end - outcome.shard.start)
        return (-1, 0, 0)

    @rule(target=leases)
    def lease_round(self) -> Any:
        consumer = RoundConsumer(self.round, self.position)
        result = self._try(lambda: self.book.lease(NAME, consumer, self.now))
        if result is None:
            return (-1, 0, 0)
        outcome, events = result
        self._record(events)
        # Every rank of the round asking the same position hears the same.
        again, more = self.book.lease(NAME, consumer, self.now)
        assert more == [] and again == outcome
        if outcome.answer is not Answer.WAIT:
            self.position += 1
        if outcome.answer is Answer.SHARD:
            assert outcome.shard is not None
            return (outcome.shard.lease_id, self.round, outcome.shard.end - outcome.shard.start)
        return (-1, 0, 0)

    @rule(target=leases, count=st.integers(2, 4))
    def lease_round_run(self, count: int) -> Any:
        """Several positions in one request: each answers as asked alone."""
        consumer = RoundConsumer(self.round, self.position)
        result = self._try(lambda: self.book.lease_run(NAME, consumer, count, self.now))
        if result is None:
            return multiple()
        outcomes, events = result
        self._record(events)
        assert 1 <= len(outcomes) <= count
        assert all(o.answer is Answer.SHARD for o in outcomes[1:])
        for offset, outcome in enumerate(outcomes):
            again, more = self.book.lease(
                NAME, RoundConsumer(self.round, self.position + offset), self.now
            )
            assert more == [] and again == outcome
        if outcomes[0].answer is not Answer.WAIT:
            self.position += len(outcomes)
        return multiple(
            *[
                (o.shard.lease_id, self.round, o.shard.end - o.shard.start)
                for o in outcomes
                if o.shard is not None
            ]
        )

    @rule()
    def lease_round_skipping_ahead_is_rejected(self) -> None:
        ds = self.book.datasets[NAME]
        ahead = (ds.next_position if ds.round == self.round else 0) + 1
        self._rejected(lambda: self.book.lease(NAME, RoundConsumer(self.round, ahead), self.now))

    @rule()
    def begin_round(self) -> None:
        self.round += 1
        self.position = 0
        self._record(self.book.begin_round(self.round))

    @rule()
    def stale_round_is_rejected(self) -> None:
        if self.round > 1:
            self._rejected(
                lambda: self.book.lease(NAME, RoundConsumer(self.round - 1, 0), self.now)
            )

    @rule(lease=leases, fraction=st.floats(0, 1))
    def renew(self, lease: tuple[int, int, int], fraction: float) -> None:
        lease_id, round_, length = lease
        consumed = int(length * fraction)
        result = self._try(lambda: self.book.renew(NAME, lease_id, round_, consumed, self.now))
        if result is not None:
            self._record(result[1])

    @rule(lease=consumes(leases))
    def report_done(self, lease: tuple[int, int, int]) -> None:
        lease_id, round_, _ = lease
        result = self._try(lambda: self.book.report_done(NAME, lease_id, round_, self.now))
        if result is not None:
            duplicate, events = result
            self._record(events)
            assert self.book.report_done(NAME, lease_id, round_, self.now) == (True, [])
            assert duplicate == (events == [])

    @rule(held=consumes(leases), fraction=st.floats(0, 1))
    def report_failure(self, held: tuple[int, int, int], fraction: float) -> None:
        lease_id, round_, length = held
        consumed = int(length * fraction)
        ds = self.book.datasets[NAME]
        lease = ds.doing.get(lease_id)
        result = self._try(
            lambda: self.book.report_failure(NAME, lease_id, round_, consumed, "bad", self.now)
        )
        if result is None or lease is None:
            return
        self._record(result)
        cut = lease.start + max(consumed, lease.consumed)
        if cut == lease.end:
            return
        key = (lease.epoch, lease.shard)
        self.failures[key] += 1
        failed = [
            f for f in ds.failed if (f.epoch, f.start, f.end) == (lease.epoch, cut, lease.end)
        ]
        if self.failures[key] >= ds.config.max_shard_failures:
            assert failed, "a shard that failed max_shard_failures times must be FAILED"
            assert failed[-1].failures == self.failures[key]
        else:
            assert not failed, "a shard was marked FAILED too early"
            if ds.epoch == lease.epoch:
                assert ds.requeued[0] == (lease.shard, cut, lease.end), "not requeued at head"

    @rule(lease=leases)
    def consumed_out_of_range_is_rejected(self, lease: tuple[int, int, int]) -> None:
        lease_id, round_, length = lease
        if lease_id in self.book.datasets[NAME].doing:
            self._rejected(lambda: self.book.renew(NAME, lease_id, round_, length + 1, self.now))

    @rule(dt=st.integers(1, 2 * TIMEOUT))
    def time_passes(self, dt: int) -> None:
        self.now += dt
        self._record(self.book.expire(self.now))

    @rule(node=st.sampled_from(["a", "b", "c"]))
    def node_dies(self, node: str) -> None:
        self._record(self.book.release_node(node))

    @rule(target=snapshots, lease=leases, fraction=st.floats(0, 1))
    def snapshot(self, lease: tuple[int, int, int], fraction: float) -> Snapshot:
        lease_id, round_, length = lease
        ds = self.book.datasets[NAME]
        progress = []
        if lease_id in ds.doing and ds.doing[lease_id].round == round_:
            progress = [(lease_id, max(ds.doing[lease_id].consumed, int(length * fraction)))]
        result = self._try(lambda: self.book.snapshot(NAME, round_, progress, self.now))
        if result is None:
            snap, events = self.book.snapshot(NAME, 0, [], self.now)
        else:
            snap, events = result
        self._record(events)
        return snap

    @rule(snap=snapshots)
    def restore(self, snap: Snapshot) -> None:
        applied, events = self.book.restore(snap, self.round, self.now)
        self._record(events)
        assert applied or events == []
        # Idempotent: every rank may restore the same snapshot.
        assert self.book.restore(snap, self.round, self.now) == (False, [])
        if applied:
            assert not self.book.datasets[NAME].doing, "restore left a live lease"
            again, _ = self.book.snapshot(NAME, 0, [], self.now)
            assert again == snap, "snapshot -> restore -> snapshot must be the identity"
            self.failures = Counter(
                {
                    (f.epoch, f.start // self.book.datasets[NAME].config.shard_size): f.failures
                    for f in snap.failed
                }
            )
        self.last_done = None

    # ---------------------------------------------------------- invariants

    @invariant()
    def every_position_is_in_exactly_one_state(self) -> None:
        ds = self.book.datasets.get(NAME)
        if ds is None or ds.finished:
            return
        seen: Counter[int] = Counter()
        for _, start, end in ds.requeued:
            seen.update(range(start, end))
        for start, end in ds.fresh:
            seen.update(range(start, end))
        for lease in ds.doing.values():
            assert lease.epoch == ds.epoch
            seen.update(range(lease.start, lease.end))
        for start, end in ds.done:
            seen.update(range(start, end))
        for failed in ds.failed:
            if failed.epoch == ds.epoch:
                seen.update(range(failed.start, failed.end))
        assert set(seen) == set(range(ds.config.epoch_length)), "a position is missing"
        assert max(seen.values(), default=1) == 1, "a position is in two states"

    @invariant()
    def done_only_grows_between_restores(self) -> None:
        ds = self.book.datasets.get(NAME)
        if ds is None:
            return
        done = list(ds.done)
        if self.last_done is not None and self.last_done["epoch"] == ds.epoch:
            for start, end in self.last_done["done"]:
                assert ds.done.covers(start, end), "DONE shrank"
        self.last_done = {"epoch": ds.epoch, "done": done}

    @invariant()
    def journal_replay_rebuilds_the_same_state(self) -> None:
        if NAME not in self.book.datasets:
            return
        replayed = ShardBook(self.book.settings)
        for text in self.journal:
            replayed.apply(Event.from_json(text))
        assert dump_dataset(replayed.datasets[NAME]) == self._state()
        assert dump_dataset(load_dataset(self._state())) == self._state()


ShardBookMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestShardBook = ShardBookMachine.TestCase
