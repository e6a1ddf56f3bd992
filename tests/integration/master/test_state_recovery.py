"""MasterState rebuilds exactly the state it had from a real store: from the
journal alone, from compacted checkpoints plus the entries after them, and from
a checkpoint entry the store had not yet moved out of the journal."""

from __future__ import annotations

import json

import pytest

from dlfleet.master.core.codec import dump_dataset
from dlfleet.master.core.datasets import DatasetConfig
from dlfleet.master.core.shards import RankConsumer, RoundConsumer, ShardSettings
from dlfleet.master.service.journal import CHECKPOINT, DATASET_PREFIX
from dlfleet.master.service.state import MasterSettings, MasterState
from dlfleet.master.store.sql import open_store

pytestmark = pytest.mark.integration


def drive(state: MasterState, steps: int) -> None:
    """A mixed workload: rank and round leases, acks, renewals, failures,
    expiries, a new round, a snapshot and a restore."""
    book = state.book
    config = DatasetConfig.create(name="d", size=500, batch_size=5, shard_size=10, epochs=3)
    state.journal.append(book.register(config)[1]).result()
    held: list[int] = []
    snap = None
    positions: dict[int, int] = {}
    for step in range(steps):
        now = step * 10
        outcome, events = book.lease("d", RankConsumer(f"n{step % 3}", 0), now, done=held)
        held = [outcome.shard.lease_id] if outcome.shard else []
        if step % 7 == 0 and outcome.shard:
            _, more = book.renew("d", outcome.shard.lease_id, 0, 4, now)
            events += more
        if step % 11 == 0 and outcome.shard:
            events += book.report_failure("d", outcome.shard.lease_id, 0, 2, "bad", now)
            held = []
        if step % 13 == 0:
            round_ = 1 + step // 50
            position = positions.get(round_, 0)
            outcome, more = book.lease("d", RoundConsumer(round_, position), now)
            positions[round_] = position + (outcome.answer.value != "wait")
            events += more
        events += book.expire(now - 200)
        if step == steps // 2:
            snap, more = book.snapshot("d", 0, [], now)
            events += more
        state.journal.append(events).result()
    assert snap is not None
    state.journal.append(book.restore(snap, 0, steps * 10)[1]).result()


@pytest.mark.parametrize("compact_every", [10**9, 25])
def test_recovery_rebuilds_the_exact_state(store_url: str, compact_every: int) -> None:
    settings = MasterSettings(
        shard=ShardSettings(lease_timeout_ms=300), compact_every=compact_every
    )
    live = MasterState(open_store(store_url), settings)
    drive(live, 120)
    live.journal.append(live.book.lease("d", RankConsumer("late", 0), 5000)[1]).result()
    expected = dump_dataset(live.book.datasets["d"])
    live.close()

    store = open_store(store_url)
    stream = store.load()[DATASET_PREFIX + "d"]
    if compact_every < 10**9:
        assert stream.checkpoint is not None, "no compaction happened"
        assert len(stream.entries) < 200, "compaction left the journal long"
    recovered = MasterState.recover(store, settings, now_ms=0)
    state = dump_dataset(recovered.book.datasets["d"])
    # Recovery re-arms live leases (a fresh timeout from now): only deadlines differ.
    for lease in expected["doing"]:
        lease["deadline_ms"] = max(lease["deadline_ms"], settings.shard.lease_timeout_ms)
    assert state == expected
    # New lease ids never collide with the ones handed out before the restart.
    outcome, _ = recovered.book.lease("d", RankConsumer("after", 0), 6000)
    if outcome.shard is not None:
        assert outcome.shard.lease_id > state["max_lease_id"]
    recovered.close()


def test_a_checkpoint_entry_still_in_the_journal_is_used(store_url: str) -> None:
    """A crash between writing a checkpoint entry and compacting the journal."""
    settings = MasterSettings(compact_every=10**9)
    live = MasterState(open_store(store_url), settings)
    drive(live, 40)
    snapshot_of_state = dump_dataset(live.book.datasets["d"])
    payload = json.dumps({"t": CHECKPOINT, "state": snapshot_of_state})
    live.committer.submit([(DATASET_PREFIX + "d", payload)]).result()
    drive_more = live.book.lease("d", RankConsumer("x", 0), 10_000)[1]
    live.journal.append(drive_more).result()
    expected = dump_dataset(live.book.datasets["d"])
    live.close()

    recovered = MasterState.recover(open_store(store_url), settings, now_ms=0)
    state = dump_dataset(recovered.book.datasets["d"])
    for lease in expected["doing"]:
        lease["deadline_ms"] = max(lease["deadline_ms"], settings.shard.lease_timeout_ms)
    assert state == expected
    recovered.close()
