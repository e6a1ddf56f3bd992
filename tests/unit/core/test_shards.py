"""Scenarios of the shard core (dlfleet.master.core.shards), each a named
specification, with time injected through `now_ms`. The randomised state
machine lives in test_shards_properties.py."""

from __future__ import annotations

from collections import Counter
from functools import partial as partial_call
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.api.errors import InvalidArgument, NotFound, StaleError
from dlfleet.master.core.codec import dump_dataset
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.events import (
    EpochCompleted,
    Event,
    LeaseDone,
    LeaseGranted,
    LeaseReleased,
    LeaseRenewed,
    ShardFailed,
)
from dlfleet.master.core.intervals import IntervalSet
from dlfleet.master.core.shards import (
    MAX_LEASE_RUN,
    Answer,
    FailedRange,
    LeaseOutcome,
    RankConsumer,
    RoundConsumer,
    ShardBook,
    ShardLease,
    ShardSettings,
    whole_shards,
)

NAME = "ds"
TIMEOUT = 100
WAIT_MS = 5
A = RankConsumer("a#1", 0)
B = RankConsumer("b#1", 0)


class Harness:
    """A ShardBook plus the journal of every event it emitted."""

    def __init__(self, **spec: Any) -> None:
        self.book = ShardBook(ShardSettings(lease_timeout_ms=TIMEOUT, wait_retry_ms=WAIT_MS))
        self.journal: list[Event] = []
        spec = {"name": NAME, "size": 40, "batch_size": 2, "shard_size": 10, **spec}
        self.config = DatasetConfig.create(**spec)
        created, events = self.book.register(self.config)
        assert created
        self.journal += events

    def lease(
        self,
        consumer: RankConsumer | RoundConsumer,
        now: int = 0,
        request_id: str = "",
        done: tuple[int, ...] = (),
    ) -> LeaseOutcome:
        outcome, events = self.book.lease(NAME, consumer, now, request_id, done)
        self.journal += events
        return outcome

    def shard(
        self,
        consumer: RankConsumer | RoundConsumer,
        now: int = 0,
        done: tuple[int, ...] = (),
        request_id: str = "",
    ) -> ShardLease:
        outcome = self.lease(consumer, now, request_id=request_id, done=done)
        assert outcome.answer is Answer.SHARD, outcome
        assert outcome.shard is not None
        return outcome.shard

    def done(self, lease: ShardLease, now: int = 0) -> bool:
        duplicate, events = self.book.report_done(NAME, lease.lease_id, lease.round, now)
        self.journal += events
        return duplicate

    def renew(self, lease: ShardLease, consumed: int, now: int = 0) -> int:
        deadline, events = self.book.renew(NAME, lease.lease_id, lease.round, consumed, now)
        self.journal += events
        return deadline

    def fail(self, lease: ShardLease, consumed: int, now: int = 0, reason: str = "oom") -> None:
        self.journal += self.book.report_failure(
            NAME, lease.lease_id, lease.round, consumed, reason, now
        )

    def expire(self, now: int) -> list[Event]:
        events = self.book.expire(now)
        self.journal += events
        return events

    def state(self) -> dict[str, Any]:
        return dump_dataset(self.book.datasets[NAME])

    def rejected(self, error: type[Exception], call: Any) -> None:
        """`call` raises `error` and changes nothing."""
        before = self.state()
        with pytest.raises(error):
            call()
        assert self.state() == before


def span(lease: ShardLease) -> tuple[int, int]:
    return lease.start, lease.end


Heard = tuple[Answer, int, tuple[int, int] | None]


def heard(outcome: LeaseOutcome) -> Heard:
    """What a consumer hears: the answer, its epoch, and the positions if a shard."""
    return outcome.answer, outcome.epoch, span(outcome.shard) if outcome.shard else None


# ------------------------------------------------------------- registration


def test_identical_registration_is_idempotent() -> None:
    h = Harness()
    assert h.book.register(h.config) == (False, [])
    assert h.book.register(DatasetConfig.from_dict(h.config.to_dict())) == (False, [])


def test_conflicting_registration_is_invalid_argument() -> None:
    h = Harness(batch_size=2)
    other = DatasetConfig.create(name=NAME, size=40, batch_size=4, shard_size=10)
    h.rejected(InvalidArgument, lambda: h.book.register(other))
    with pytest.raises(InvalidArgument, match="batch_size"):
        h.book.register(other)


def test_an_unknown_dataset_is_not_found() -> None:
    h = Harness()
    with pytest.raises(NotFound):
        h.book.lease("nope", A, 0)
    with pytest.raises(NotFound):
        h.book.status("nope")


def test_shards_are_handed_out_in_position_order_and_cut_at_shard_boundaries() -> None:
    h = Harness(size=25, batch_size=5, shard_size=10)
    assert [span(h.shard(A)) for _ in range(3)] == [(0, 10), (10, 20), (20, 25)]
    assert h.lease(B).answer is Answer.END_OF_EPOCH


def test_a_bad_rank_consumer_is_invalid_argument() -> None:
    h = Harness()
    h.rejected(InvalidArgument, lambda: h.book.lease(NAME, RankConsumer("a#1", -1), 0))
    h.rejected(InvalidArgument, lambda: h.book.lease(NAME, RankConsumer("", 0), 0))


# ---------------------------------------------------- expiry, death, failure


def test_expired_lease_returns_unconsumed_remainder_to_head_of_todo() -> None:
    h = Harness()
    first = h.shard(A, now=0)
    assert h.renew(first, consumed=4, now=10) == 10 + TIMEOUT
    second = h.shard(B, now=20)
    assert span(second) == (10, 20)

    assert h.expire(now=10 + TIMEOUT - 1) == []
    events = h.expire(now=10 + TIMEOUT)
    assert events == [LeaseReleased(NAME, first.lease_id, 4, "expired")]

    status = h.book.status(NAME)
    assert (status.records_done, status.records_doing, status.records_todo) == (4, 10, 26)
    assert span(h.shard(A, now=111)) == (4, 10), "the remainder goes to the head of TODO"
    assert span(h.shard(A, now=112)) == (20, 30)
    assert status.failed == ()


def test_records_trained_move_with_the_renewals_of_live_leases_not_only_with_acks() -> None:
    h = Harness(epochs=2)
    first, second = h.shard(A, now=0), h.shard(B, now=0)
    assert h.book.status(NAME).records_trained == 0
    h.renew(first, consumed=4, now=1)
    h.renew(second, consumed=6, now=1)
    status = h.book.status(NAME)
    assert (status.records_done, status.records_consumed, status.records_doing) == (0, 10, 10)
    assert status.records_trained == 10
    h.done(first, now=2)  # acked: its whole length counts, its renewals no more
    assert h.book.status(NAME).records_trained == 10 + 6
    for consumer in (A, B):  # the rest of the epoch, acked
        h.done(h.shard(consumer, now=3), now=3)
    h.done(second, now=3)
    assert h.book.status(NAME).epoch == 1
    assert h.lease(A, now=4).answer is Answer.END_OF_EPOCH  # A's own end of epoch 0
    h.renew(h.shard(A, now=4), consumed=3, now=5)
    assert h.book.status(NAME).records_trained == 40 + 3


def test_expiry_does_not_count_against_the_shard() -> None:
    h = Harness(max_shard_failures=1)
    for now in range(0, 5 * (TIMEOUT + 1), TIMEOUT + 1):
        lease = h.shard(A, now=now)
        assert span(lease) == (0, 10)
        h.expire(now + TIMEOUT)
    assert h.book.status(NAME).failed == ()


def test_report_of_expired_lease_is_rejected() -> None:
    h = Harness()
    lease = h.shard(A, now=0)
    # Past its deadline it is stale even before expire() has run...
    h.rejected(StaleError, lambda: h.done(lease, now=TIMEOUT))
    h.rejected(StaleError, lambda: h.renew(lease, 3, now=TIMEOUT))
    h.rejected(StaleError, lambda: h.fail(lease, 3, now=TIMEOUT))
    # ...and after it, even with a clock that went back.
    h.expire(TIMEOUT)
    h.rejected(StaleError, lambda: h.done(lease, now=1))
    h.rejected(StaleError, lambda: h.lease(A, now=1, done=(lease.lease_id,)))


def test_renewal_extends_the_deadline_and_never_shortens_it() -> None:
    h = Harness()
    lease = h.shard(A, now=0)
    assert h.renew(lease, 2, now=50) == 50 + TIMEOUT
    assert h.expire(now=TIMEOUT) == []
    assert h.renew(lease, 3, now=10) == 50 + TIMEOUT
    assert not h.done(lease, now=50 + TIMEOUT - 1)


def test_consumed_outside_the_lease_is_invalid_argument() -> None:
    h = Harness()
    lease = h.shard(A)
    h.rejected(InvalidArgument, lambda: h.renew(lease, 11))
    h.rejected(InvalidArgument, lambda: h.renew(lease, -1))
    h.rejected(InvalidArgument, lambda: h.fail(lease, 11))


def test_explicit_failure_counts_and_marks_shard_failed_after_max_failures() -> None:
    h = Harness(max_shard_failures=2)
    first = h.shard(A)
    h.fail(first, consumed=3, reason="disk error")
    assert h.book.status(NAME).failed == ()

    retry = h.shard(B)
    assert span(retry) == (3, 10), "a failed remainder is retried first"
    h.fail(retry, consumed=2, reason="disk error again")

    status = h.book.status(NAME)
    assert status.failed == (FailedRange(0, 5, 10, 2, "disk error again"),)
    assert status.records_done == 5
    assert span(h.shard(A)) == (10, 20), "a FAILED range is not handed out again"


def test_a_failure_after_consuming_the_whole_lease_counts_as_done() -> None:
    h = Harness(max_shard_failures=1)
    lease = h.shard(A)
    h.fail(lease, consumed=10)
    status = h.book.status(NAME)
    assert (status.failed, status.records_done) == ((), 10)


def test_failed_ranges_do_not_block_the_end_of_the_epoch() -> None:
    h = Harness(size=20, max_shard_failures=1, epochs=2)
    h.fail(h.shard(A), consumed=0)
    h.done(h.shard(A))
    assert h.book.status(NAME).epoch == 1
    assert h.lease(A).answer is Answer.END_OF_EPOCH
    assert span(h.shard(A)) == (0, 10), "the next epoch starts with every shard again"
    assert h.book.status(NAME).failed == (FailedRange(0, 0, 10, 1, "oom"),)


def test_long_failure_reasons_are_truncated() -> None:
    h = Harness()
    h.fail(h.shard(A), consumed=0, reason="x" * 10_000)
    failed = [e for e in h.journal if isinstance(e, ShardFailed)]
    assert len(failed[0].reason) == 500


def test_holder_death_releases_leases_without_counting_failure() -> None:
    h = Harness(max_shard_failures=1)
    dead = h.shard(A)
    h.renew(dead, consumed=5)
    alive = h.shard(B)

    events = h.book.release_node("a#1")
    h.journal += events
    assert events == [LeaseReleased(NAME, dead.lease_id, 5, "holder_died")]
    assert h.book.lease_ids_for(NAME) == [alive.lease_id]
    assert span(h.shard(B)) == (5, 10)
    assert h.book.status(NAME).failed == ()
    assert h.book.release_node("a#1") == []


def test_a_new_round_releases_older_round_leases_without_counting_failure() -> None:
    h = Harness(max_shard_failures=1)
    old = h.shard(RoundConsumer(1, 0))
    rank = h.shard(A)
    h.book.renew(NAME, old.lease_id, 1, 4, 0)
    h.journal += h.book.begin_round(2)
    assert h.book.lease_ids_for(NAME) == [rank.lease_id], "rank leases are not in a round"
    assert span(h.shard(RoundConsumer(2, 0))) == (4, 10)
    assert h.book.status(NAME).failed == ()


# ------------------------------------------------------------------ rounds


def test_round_consumers_at_same_position_get_same_shard() -> None:
    h = Harness()
    first = h.lease(RoundConsumer(1, 0))
    for _ in range(3):
        again, events = h.book.lease(NAME, RoundConsumer(1, 0), 1)
        assert (again, events) == (first, [])
    second = h.shard(RoundConsumer(1, 1))
    assert first.shard is not None
    assert span(second) == (10, 20) != span(first.shard)
    assert h.book.lease(NAME, RoundConsumer(1, 0), 2)[0] == first


def test_all_ranks_of_a_round_see_end_of_epoch_at_same_position() -> None:
    h = Harness(size=30, epochs=2)
    ranks = 4
    answers: list[list[Heard]] = [[] for _ in range(ranks)]
    previous: list[int | None] = [None] * ranks
    position = 0
    while len(answers[0]) < 12:
        for rank in range(ranks):
            prev = previous[rank]
            done = () if prev is None else (prev,)
            outcome = h.lease(RoundConsumer(1, position), now=position, done=done)
            answers[rank].append(heard(outcome))
            previous[rank] = outcome.shard.lease_id if outcome.shard else None
        if answers[0][-1][0] is Answer.END_OF_DATASET:
            break
        position += 1

    assert all(a == answers[0] for a in answers), "every rank hears the same at every position"
    shard, eoe, eod = Answer.SHARD, Answer.END_OF_EPOCH, Answer.END_OF_DATASET
    assert answers[0] == [
        (shard, 0, (0, 10)), (shard, 0, (10, 20)), (shard, 0, (20, 30)), (eoe, 0, None),
        (shard, 1, (0, 10)), (shard, 1, (10, 20)), (shard, 1, (20, 30)), (eoe, 1, None),
        (eod, 2, None),
    ]  # fmt: skip


def test_a_run_of_positions_answers_as_single_requests_and_stops_before_end_of_epoch() -> None:
    h = Harness(size=40, epochs=2)

    def run(position: int, count: int, done: tuple[int, ...] = ()) -> list[Heard]:
        outcomes, events = h.book.lease_run(NAME, RoundConsumer(1, position), count, 0, done)
        h.journal += events
        return [heard(o) for o in outcomes]

    shard, eoe = Answer.SHARD, Answer.END_OF_EPOCH
    # Rank 0 asks two positions at once, rank 1 one at a time: the same shards.
    assert run(0, 2) == [(shard, 0, (0, 10)), (shard, 0, (10, 20))]
    assert run(0, 1) == [(shard, 0, (0, 10))]
    # A run may start on replays and go on with fresh positions; it stops
    # before position 4, whose answer (END_OF_EPOCH) is decided only when asked.
    assert run(1, 8) == [(shard, 0, (10, 20)), (shard, 0, (20, 30)), (shard, 0, (30, 40))]
    assert h.book.datasets[NAME].next_position == 4
    assert run(2, 8) == [(shard, 0, (20, 30)), (shard, 0, (30, 40))]
    leases = [lease.lease_id for lease in h.book.datasets[NAME].doing.values()]
    assert run(4, 8, done=tuple(leases)) == [(eoe, 0, None)]
    assert run(4, 8) == [(eoe, 0, None)], "every rank hears the same at position 4"
    assert run(5, 3) == [(shard, 1, (0, 10)), (shard, 1, (10, 20)), (shard, 1, (20, 30))]

    replayed = ShardBook(h.book.settings)
    for event in h.journal:
        replayed.apply(Event.from_json(event.to_json()))
    assert dump_dataset(replayed.datasets[NAME]) == h.state()


def test_a_run_of_positions_is_bounded_and_a_refused_run_changes_nothing() -> None:
    h = Harness(size=10_000, shard_size=10)
    outcomes, _ = h.book.lease_run(NAME, RoundConsumer(1, 0), 1 << 31, 0)
    assert len(outcomes) == MAX_LEASE_RUN
    h.rejected(InvalidArgument, lambda: h.book.lease_run(NAME, RoundConsumer(1, 99), 4, 0))
    h.rejected(StaleError, lambda: h.book.lease_run(NAME, RoundConsumer(1, 0), 4, 0, (12345,)))


def test_stale_round_is_rejected_and_changes_nothing() -> None:
    h = Harness()
    old = h.shard(RoundConsumer(1, 0))
    h.journal += h.book.begin_round(2)
    new = h.shard(RoundConsumer(2, 0))

    h.rejected(StaleError, lambda: h.lease(RoundConsumer(1, 0)))
    h.rejected(StaleError, lambda: h.lease(RoundConsumer(1, 1)))
    h.rejected(StaleError, lambda: h.done(old))
    h.rejected(StaleError, lambda: h.renew(old, 1))
    h.rejected(StaleError, lambda: h.book.snapshot(NAME, 1, [], 0))
    h.rejected(StaleError, lambda: h.book.report_done(NAME, new.lease_id, 1, 0))
    assert h.book.begin_round(1) == []
    assert h.book.lease_ids_for(NAME) == [new.lease_id]


def test_a_round_position_may_not_skip_ahead() -> None:
    h = Harness()
    h.shard(RoundConsumer(1, 0))
    h.rejected(InvalidArgument, lambda: h.lease(RoundConsumer(1, 2)))
    h.rejected(InvalidArgument, lambda: h.lease(RoundConsumer(2, 1)))
    h.rejected(InvalidArgument, lambda: h.lease(RoundConsumer(0, 0)))
    h.rejected(InvalidArgument, lambda: h.lease(RoundConsumer(1, -1)))


# --------------------------------------------------------------- reporting


def test_repeated_done_report_is_duplicate_not_double_counted() -> None:
    h = Harness()
    lease = h.shard(A)
    assert h.done(lease) is False
    for _ in range(3):
        assert h.book.report_done(NAME, lease.lease_id, 0, 0) == (True, [])
    h.shard(B, done=(lease.lease_id, lease.lease_id))  # a piggybacked repeat, twice
    status = h.book.status(NAME)
    assert status.records_done == 10
    assert sum(isinstance(e, LeaseDone) for e in h.journal) == 1


def test_done_piggybacked_on_lease_is_reported_atomically() -> None:
    h = Harness()
    first = h.shard(A)
    outcome, events = h.book.lease(NAME, A, 0, done=[first.lease_id])
    h.journal += events
    assert outcome.shard is not None
    assert [type(e) for e in events] == [LeaseDone, LeaseGranted]
    assert h.book.status(NAME).records_done == 10

    second = outcome.shard
    never_granted = 999
    h.rejected(StaleError, lambda: h.lease(A, done=(second.lease_id, never_granted)))
    assert h.book.lease_ids_for(NAME) == [second.lease_id], "nothing was reported or granted"


def test_request_id_retry_returns_same_lease() -> None:
    h = Harness()
    first = h.shard(A, request_id="req-1")
    again, events = h.book.lease(NAME, A, 1, request_id="req-1")
    assert events == []
    assert again.shard == first
    other = h.shard(A, request_id="req-2")
    assert other.lease_id != first.lease_id
    assert h.shard(B, request_id="req-2").lease_id != other.lease_id, "ids are per consumer"


def test_request_id_retry_after_the_lease_is_gone_grants_a_new_one() -> None:
    h = Harness()
    first = h.shard(A, request_id="req-1")
    h.done(first)
    assert span(h.shard(A, request_id="req-1")) == (10, 20)


# ------------------------------------------------------ snapshot / restore


def test_snapshot_includes_consumed_progress_of_live_leases() -> None:
    h = Harness()
    renewed = h.shard(A)
    h.renew(renewed, consumed=6)
    reported = h.shard(B)
    untouched = h.shard(A)

    snap, events = h.book.snapshot(NAME, 0, [(reported.lease_id, 4)], 0)
    h.journal += events
    assert events == [LeaseRenewed(NAME, reported.lease_id, 4, reported.deadline_ms)]
    assert snap.done == ((0, 6), (10, 14))
    assert snap.epoch == 0 and not snap.finished
    assert h.book.lease_ids_for(NAME) == [renewed.lease_id, reported.lease_id, untouched.lease_id]


def test_snapshot_of_a_lease_with_less_progress_than_known_keeps_the_known() -> None:
    h = Harness()
    lease = h.shard(A)
    h.renew(lease, consumed=6)
    snap, events = h.book.snapshot(NAME, 0, [(lease.lease_id, 2)], 0)
    assert (snap.done, events) == (((0, 6),), [])


def test_restore_invalidates_live_leases_and_replays_exactly_the_untrained_records() -> None:
    h = Harness(size=60, shard_size=10)
    trained: Counter[int] = Counter()  # positions in the model's lineage

    whole = h.shard(A)
    h.done(whole)
    trained.update(range(*span(whole)))
    partial = h.shard(B)
    h.renew(partial, consumed=2)
    untouched = h.shard(A)
    snap, events = h.book.snapshot(NAME, 0, [(partial.lease_id, 3)], 0)
    h.journal += events
    trained.update(range(partial.start, partial.start + 3))

    # Work after the checkpoint is lost when the job rolls back to it.
    h.renew(partial, consumed=7)
    h.done(untouched)
    h.done(h.shard(B))

    applied, events = h.book.restore(snap, 1, 0)
    h.journal += events
    assert applied
    assert h.book.restore(snap, 1, 0) == (False, []), "every rank of a round may restore"
    assert h.book.lease_ids_for(NAME) == []
    for stale in (partial, untouched):
        h.rejected(StaleError, partial_call(h.done, stale))
        h.rejected(StaleError, partial_call(h.renew, stale, 1))

    consumers = [A, B]
    while True:
        outcome = h.lease(consumers[len(trained) % 2])
        if outcome.answer is not Answer.SHARD:
            break
        assert outcome.shard is not None
        trained.update(range(*span(outcome.shard)))
        h.done(outcome.shard)
    assert outcome.answer is Answer.END_OF_EPOCH
    assert trained == Counter(range(60)), "every position of the epoch trained exactly once"


def test_restore_without_a_round_applies_every_time_so_a_job_can_roll_back_twice() -> None:
    h = Harness(size=40, shard_size=10)
    h.done(h.shard(A))
    snap, _ = h.book.snapshot(NAME, 0, [], 0)
    assert h.book.restore(snap, 0, 0)[0]
    h.done(h.shard(A))
    assert h.book.status(NAME).records_done == 20
    applied, events = h.book.restore(snap, 0, 0)
    h.journal += events
    assert applied
    assert h.book.status(NAME).records_done == 10


def test_restore_of_other_dataset_spec_is_rejected() -> None:
    h = Harness(seed=1)
    other = Harness(seed=2)
    snap, _ = other.book.snapshot(NAME, 0, [], 0)
    h.rejected(InvalidArgument, lambda: h.book.restore(snap, 0, 0))
    with pytest.raises(InvalidArgument, match="different dataset spec"):
        h.book.restore(snap, 0, 0)


def test_snapshot_restore_snapshot_is_the_identity() -> None:
    h = Harness(epochs=2)
    h.done(h.shard(A))
    failing = h.shard(A)
    h.fail(failing, consumed=1)
    h.renew(h.shard(B), consumed=3)
    snap, _ = h.book.snapshot(NAME, 0, [], 0)
    fresh = Harness(epochs=2)
    assert fresh.book.restore(snap, 0, 0)[0]
    assert fresh.book.snapshot(NAME, 0, [], 0)[0] == snap


# ----------------------------------------------------------------- epochs


def test_epochs_advance_and_dataset_ends() -> None:
    h = Harness(size=20, epochs=2)
    answers: list[Heard] = []
    held: tuple[int, ...] = ()
    for now in range(10):
        outcome = h.lease(A, now=now, done=held)
        answers.append(heard(outcome))
        held = (outcome.shard.lease_id,) if outcome.shard else ()
        if outcome.answer is Answer.END_OF_DATASET:
            break
    shard, eoe, eod = Answer.SHARD, Answer.END_OF_EPOCH, Answer.END_OF_DATASET
    assert answers == [
        (shard, 0, (0, 10)), (shard, 0, (10, 20)), (eoe, 0, None),
        (shard, 1, (0, 10)), (shard, 1, (10, 20)), (eoe, 1, None),
        (eod, 2, None),
    ]  # fmt: skip
    assert [e.epoch for e in h.journal if isinstance(e, EpochCompleted)] == [0, 1]
    status = h.book.status(NAME)
    assert status.finished and status.epoch == 2
    assert h.lease(B).answer is Answer.END_OF_DATASET


def test_wait_when_todo_empty_but_leases_outstanding() -> None:
    h = Harness(size=20, epochs=2)
    first = h.shard(A)
    last = h.shard(B)
    told = h.lease(A, done=(first.lease_id,))
    assert (told.answer, told.epoch) == (Answer.END_OF_EPOCH, 0)

    waiting = h.lease(A)
    assert (waiting.answer, waiting.retry_after_ms) == (Answer.WAIT, WAIT_MS)
    assert h.lease(A).answer is Answer.WAIT

    h.done(last)
    assert h.shard(A).epoch == 1
    catching_up = h.lease(B)
    assert (catching_up.answer, catching_up.epoch) == (Answer.END_OF_EPOCH, 0)


def test_an_expired_last_lease_is_finished_by_a_consumer_already_waiting() -> None:
    h = Harness(size=20)
    h.done(h.shard(A))
    h.shard(B, now=0)
    assert h.lease(A).answer is Answer.END_OF_EPOCH
    assert h.lease(A).answer is Answer.WAIT
    h.expire(TIMEOUT)
    rescue = h.shard(A, now=TIMEOUT)
    assert (span(rescue), rescue.epoch) == ((10, 20), 0)


def test_a_million_shard_epoch_costs_memory_proportional_to_shards_touched() -> None:
    h = Harness(size=10**9, batch_size=100, shard_size=10**3)
    assert h.config.shards_per_epoch == 10**6
    held: tuple[int, ...] = ()
    for now in range(1000):
        lease = h.shard(A, now=now, done=held)
        held = (lease.lease_id,)
    h.done(lease, now=1000)

    ds = h.book.datasets[NAME]
    assert list(ds.done) == [(0, 10**6)]
    assert list(ds.fresh) == [(10**6, 10**9)]
    assert not ds.requeued and not ds.doing
    status = h.book.status(NAME)
    assert (status.records_done, status.records_todo) == (10**6, 10**9 - 10**6)
    snap, _ = h.book.snapshot(NAME, 0, [], 1000)
    assert snap.done == ((0, 10**6),)
    assert h.state()["done_leases"] == [[1, 1001]], "done lease ids merge into one range"


# ----------------------------------------------------------------- journal


def test_journal_replay_equals_live_state() -> None:
    h = Harness(size=50, epochs=3, max_shard_failures=2)
    h.done(h.shard(A, now=0))
    h.renew(h.shard(B, now=1), consumed=4, now=2)
    h.expire(now=2 + TIMEOUT)
    h.fail(h.shard(A, now=200), consumed=1, now=201)
    h.shard(A, now=202, request_id="r")
    h.journal += h.book.release_node("a#1")
    round_lease = h.shard(RoundConsumer(1, 0), now=300)
    h.shard(RoundConsumer(1, 1), now=301, done=(round_lease.lease_id,))
    h.journal += h.book.rearm(now_ms=350)
    snap, events = h.book.snapshot(NAME, 1, [], 360)
    h.journal += events
    h.journal += h.book.begin_round(2)
    h.journal += h.book.restore(snap, 2, 400)[1]
    for position in range(100):
        outcome = h.lease(RoundConsumer(2, position), now=400)
        if outcome.answer is Answer.END_OF_DATASET:
            break
        if outcome.shard is not None:
            h.done(outcome.shard, now=401)
    assert h.book.status(NAME).finished
    assert {type(e).__name__ for e in h.journal} >= {
        "DatasetRegistered", "RoundAdvanced", "LeaseGranted", "LeaseRenewed", "LeaseDone",
        "LeaseReleased", "ShardFailed", "ConsumerAnswered", "EpochCompleted", "Restored",
    }  # fmt: skip

    replayed = ShardBook(h.book.settings)
    for event in h.journal:
        replayed.apply(Event.from_json(event.to_json()))
    assert dump_dataset(replayed.datasets[NAME]) == h.state()
    assert replayed.status(NAME) == h.book.status(NAME)


@given(
    size=st.integers(1, 60),
    shard_size=st.integers(1, 12),
    cuts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=6),
)
def test_whole_shards_counts_the_shards_every_position_of_which_is_done(
    size: int, shard_size: int, cuts: list[tuple[int, int]]
) -> None:
    config = DatasetConfig.create(name=NAME, size=size, batch_size=1, shard_size=shard_size)
    done = IntervalSet((min(start, size), min(start + length, size)) for start, length in cuts)
    expected = sum(
        done.covers(shard * shard_size, config.shard_end(shard))
        for shard in range(config.shards_per_epoch)
    )
    assert whole_shards(done, config) == expected
