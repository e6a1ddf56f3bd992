"""The loader's bulk position -> record mapping is `EpochPermutation`'s, bit
for bit: the loader must never train records the master did not hand out."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfleet.api.permutation import EpochPermutation
from dlfleet.worker.loader.indexing import BLOCK, PositionIndexer


@pytest.mark.parametrize("size", [1, 2, 7, 203, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_position_of_an_epoch_maps_as_the_permutation_does(size: int, shuffle: bool) -> None:
    permutation = EpochPermutation(size, 11, 3, shuffle)
    indexer = PositionIndexer(permutation)
    assert indexer.indices(list(range(size))) == [permutation[p] for p in range(size)]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 10**10),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
    data=st.data(),
)
def test_runs_and_scattered_positions_of_huge_datasets_agree(
    size: int, seed: int, epoch: int, data: st.DataObject
) -> None:
    permutation = EpochPermutation(size, seed, epoch)
    indexer = PositionIndexer(permutation)
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    positions = sorted(rng.randrange(size) for _ in range(50))
    assert indexer.indices(positions) == [permutation[p] for p in positions]
    start = data.draw(st.integers(0, size - 1))
    end = min(size, start + data.draw(st.integers(1, 300)))
    assert indexer.ranges([(start, end)]) == [permutation[p] for p in range(start, end)]


@settings(max_examples=80, deadline=None)
@given(start=st.integers(0, 3 * BLOCK + 4), length=st.integers(1, 2 * BLOCK))
def test_one_run_maps_as_the_permutation_does_within_a_block_and_across_blocks(
    start: int, length: int
) -> None:
    # One run is the common case (a rank's slice of a batch of one lease),
    # taken by a shorter path when it lies within one block.
    size = 3 * BLOCK + 5
    permutation = EpochPermutation(size, 5, 2)
    indexer = PositionIndexer(permutation)
    end = min(size, start + length)
    assert indexer.ranges([(start, end)]) == [permutation[p] for p in range(start, end)]
