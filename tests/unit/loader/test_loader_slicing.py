"""The pure slicing of leased position ranges into per-rank batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfleet.worker.loader.slicing import (
    BatchCutter,
    GlobalBatch,
    Segment,
    batches_per_epoch,
    share_key,
    shuffle_share,
)


def cut_epoch(lengths: list[int], batch: int, world: int) -> list[GlobalBatch]:
    """Segments of the given lengths over consecutive positions, one lease each."""
    cutter = BatchCutter(batch * world, world)
    out: list[GlobalBatch] = []
    start = 0
    for lease_id, length in enumerate(lengths, start=1):
        out += cutter.push(Segment(lease_id, start, start + length))
        start += length
    return out + cutter.finish()


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    batch=st.integers(1, 6),
    world=st.integers(1, 5),
)
def test_every_position_goes_to_exactly_one_rank_step_and_ranks_stay_in_lockstep(
    lengths: list[int], batch: int, world: int
) -> None:
    total = sum(lengths)
    batches = cut_epoch(lengths, batch, world)
    per_rank = [[gb.rank_positions(r, world) for gb in batches] for r in range(world)]

    # Every rank yields the same number of batches: one per global batch.
    assert {len(steps) for steps in per_rank} == {len(batches)}
    seen = [p for steps in per_rank for step in steps for p in step]
    assert sorted(seen) == list(range(total))  # nothing lost, nothing repeated

    # Full batches everywhere but the last global batch of the epoch.
    for gb in batches[:-1]:
        assert gb.size == batch * world
        assert all(len(gb.rank_positions(r, world)) == batch for r in range(world))
    last = [len(batches[-1].rank_positions(r, world)) for r in range(world)]
    assert max(last) - min(last) <= 1
    # An empty rank batch only when the whole epoch is smaller than the world.
    assert min(last) > 0 or total < world
    # The count is known in advance, from the epoch's length alone.
    assert len(batches) == batches_per_epoch(total, batch * world, world)


def test_a_global_batch_straddling_two_shards_acks_both_leases_by_count() -> None:
    batches = cut_epoch([3, 5], batch=2, world=2)
    assert [gb.lease_counts() for gb in batches] == [[(1, 3), (2, 1)], [(2, 4)]]


def test_a_tail_smaller_than_the_world_merges_into_the_last_full_batch() -> None:
    batches = cut_epoch([9], batch=2, world=2)  # 2 full global batches of 4 + 1
    assert [gb.size for gb in batches] == [4, 5]
    assert [batches[-1].rank_positions(r, 2) for r in range(2)] == [[4, 5], [6, 7, 8]]


def test_a_tail_of_at_least_the_world_is_its_own_batch_split_evenly() -> None:
    batches = cut_epoch([11], batch=2, world=2)
    assert [gb.size for gb in batches] == [4, 4, 3]
    assert [batches[-1].rank_positions(r, 2) for r in range(2)] == [[8], [9, 10]]


def test_a_global_batch_smaller_than_the_world_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot be split"):
        BatchCutter(1, 2)


@settings(max_examples=100, deadline=None)
@given(
    records=st.lists(st.integers(0, 10**9), unique=True, max_size=300),
    seed=st.integers(0, 2**64),
    epoch=st.integers(0, 9),
    round_=st.integers(0, 9),
    first=st.integers(0, 10**7),
)
def test_a_share_is_shuffled_the_same_for_the_same_seed_epoch_round_and_batch(
    records: list[int], seed: int, epoch: int, round_: int, first: int
) -> None:
    values = np.array(records, dtype=np.int64)
    key = share_key(seed, epoch, round_, first)
    shuffled = shuffle_share(values, key)
    assert sorted(shuffled) == sorted(records)
    assert shuffle_share(values, share_key(seed, epoch, round_, first)) == shuffled
    if len(records) >= 8:  # another batch (or round): another order
        assert shuffle_share(values, share_key(seed, epoch, round_, first + 1)) != shuffled
        assert shuffle_share(values, share_key(seed, epoch, round_ + 1, first)) != shuffled
