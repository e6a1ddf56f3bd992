"""EpochPermutation: a bijection on [0, size) that is a pure function of
(size, seed, epoch), computed per position without materialising anything."""

from __future__ import annotations

import time

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from dlfleet.api.permutation import EpochPermutation

SEEDS = st.integers(0, (1 << 64) - 1)
EPOCHS = st.integers(0, 10_000)


def order(size: int, seed: int, epoch: int) -> list[int]:
    return EpochPermutation(size, seed, epoch).indices(0, size)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 16, 17, 1000])
@pytest.mark.parametrize(("seed", "epoch"), [(0, 0), (1, 0), (0, 1), (12345, 7)])
def test_is_a_bijection_on_its_range_for_small_and_odd_sizes(
    size: int, seed: int, epoch: int
) -> None:
    assert sorted(order(size, seed, epoch)) == list(range(size))


@settings(max_examples=30, deadline=None)
@given(size=st.integers(1, 5000), seed=SEEDS, epoch=EPOCHS)
def test_is_a_bijection_on_its_range_for_any_size_seed_and_epoch(
    size: int, seed: int, epoch: int
) -> None:
    assert sorted(order(size, seed, epoch)) == list(range(size))


@settings(max_examples=20, deadline=None)
@given(size=st.integers(1, 2000), seed=SEEDS, epoch=EPOCHS)
def test_is_the_identity_when_shuffle_is_off(size: int, seed: int, epoch: int) -> None:
    perm = EpochPermutation(size, seed, epoch, shuffle=False)
    assert perm.indices(0, size) == list(range(size))


@settings(max_examples=20, deadline=None)
@given(size=st.integers(1, 2000), seed=SEEDS, epoch=EPOCHS)
def test_is_a_pure_function_of_size_seed_and_epoch(size: int, seed: int, epoch: int) -> None:
    assert order(size, seed, epoch) == order(size, seed, epoch)


@settings(max_examples=30, deadline=None)
@given(size=st.integers(10, 500), seed=SEEDS, epoch=EPOCHS, delta=st.integers(1, 1000))
def test_another_epoch_gives_another_order(size: int, seed: int, epoch: int, delta: int) -> None:
    assert order(size, seed, epoch) != order(size, seed, epoch + delta)


@settings(max_examples=30, deadline=None)
@given(size=st.integers(10, 500), seed=SEEDS, epoch=EPOCHS, delta=st.integers(1, 1 << 32))
def test_another_seed_gives_another_order(size: int, seed: int, epoch: int, delta: int) -> None:
    other = (seed + delta) % (1 << 64)
    assert order(size, seed, epoch) != order(size, other, epoch)


def test_consecutive_epochs_of_one_seed_are_all_different_orders() -> None:
    for size in (10, 11, 100):
        orders = {tuple(order(size, 42, epoch)) for epoch in range(50)}
        assert len(orders) == 50


def test_shuffled_order_is_not_the_identity() -> None:
    assert order(1000, 0, 0) != list(range(1000))


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 3000),
    seed=SEEDS,
    epoch=EPOCHS,
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_indices_of_a_range_match_item_lookup(
    size: int, seed: int, epoch: int, cut: tuple[float, float]
) -> None:
    start, end = sorted(int(f * size) for f in cut)
    perm = EpochPermutation(size, seed, epoch)
    assert perm.indices(start, end) == [perm[p] for p in range(start, end)]


def test_indices_of_an_empty_range_are_empty() -> None:
    assert EpochPermutation(10, 0, 0).indices(4, 4) == []


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("position", [-1, 10, 11, -(10**12), 10**12])
def test_position_outside_the_range_raises_index_error(shuffle: bool, position: int) -> None:
    perm = EpochPermutation(10, 3, 1, shuffle=shuffle)
    with pytest.raises(IndexError):
        perm[position]


def test_indices_beyond_the_end_raise_index_error() -> None:
    with pytest.raises(IndexError):
        EpochPermutation(10, 3, 1).indices(5, 11)


@pytest.mark.parametrize("size", [0, -1, -(10**9)])
def test_size_below_one_is_rejected(size: int) -> None:
    with pytest.raises(ValueError, match="size"):
        EpochPermutation(size, 0, 0)


def test_a_billion_records_shuffle_without_materialising() -> None:
    size = 10**9
    perm = EpochPermutation(size, seed=2024, epoch=3)
    positions = [0, 1, 2, size // 3, size // 2, size - 2, size - 1]
    positions += range(12_345, size, size // 2000)
    began = time.perf_counter()
    values = [perm[p] for p in positions]
    elapsed = time.perf_counter() - began
    assert all(0 <= v < size for v in values)
    assert len(set(values)) == len(set(positions))
    assert elapsed < 1.0, f"{len(positions)} lookups took {elapsed:.3f}s"
    assert EpochPermutation(size, seed=2024, epoch=3)[size - 1] == values[6]
