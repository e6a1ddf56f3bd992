"""A file catalog's epoch order (files/order.py): a bijection of positions onto
records for any catalog, seed, epoch and window; blocks read front to back."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfleet.worker.loader.files.order import BlockOrder


def blocks(counts: list[int], block: int) -> tuple[np.ndarray, np.ndarray]:
    starts: list[int] = []
    lengths: list[int] = []
    base = 0
    for count in counts:
        for first in range(0, count, block):
            starts.append(base + first)
            lengths.append(min(block, count - first))
        base += count
    return np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    block=st.integers(1, 9),
    window=st.integers(0, 30),
    seed=st.integers(0, 2**40),
    epoch=st.integers(0, 5),
    shuffle=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_every_epoch_order_is_a_bijection_however_the_positions_are_cut(
    counts: list[int],
    block: int,
    window: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    cuts: list[int],
) -> None:
    starts, lengths = blocks(counts, block)
    size = sum(counts)
    order = BlockOrder(starts, lengths, seed, epoch, shuffle, window)
    whole = order.ranges([(0, size)])
    assert sorted(whole) == list(range(size))
    if not shuffle:
        assert whole == list(range(size))
    # Leases cut the positions anywhere: the pieces map to the same records.
    edges = sorted({0, size, *(c % (size + 1) for c in cuts)})
    runs = list(itertools.pairwise(edges))
    pieces = [r for a, b in runs for r in order.ranges([(a, b)])]
    assert pieces == whole
    # Another process computes the same order (a pure function).
    again = BlockOrder(starts, lengths, seed, epoch, shuffle, window)
    assert again.ranges(runs[::-1]) == [r for a, b in runs[::-1] for r in whole[a:b]]


def reference_order(
    starts: np.ndarray, lengths: np.ndarray, seed: int, epoch: int, window: int
) -> list[int]:
    """The epoch order as documented, one position at a time: blocks in the
    seeded order, then each window of positions permuted by its own seed."""
    rng = np.random.default_rng([seed, epoch, 0xB10C])
    visit = rng.permutation(len(starts))
    records = [int(starts[b]) + i for b in visit for i in range(int(lengths[b]))]
    if window <= 1:
        return records
    out: list[int] = []
    for first in range(0, len(records), window):
        length = min(window, len(records) - first)
        perm = np.random.default_rng([seed, epoch, first // window, 0x5B0F]).permutation(length)
        out.extend(records[first + int(p)] for p in perm)
    return out


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(1, 60), min_size=1, max_size=6),
    block=st.integers(1, 9),
    window=st.integers(0, 40),
    seed=st.integers(0, 2**40),
    step=st.integers(1, 50),
)
def test_the_order_is_the_documented_one_however_it_is_asked_for(
    counts: list[int], block: int, window: int, seed: int, step: int
) -> None:
    # Positions already leased (and checkpointed) must keep meaning the same
    # records: the order is pinned, whatever the order's caching does.
    starts, lengths = blocks(counts, block)
    order = BlockOrder(starts, lengths, seed, 2, True, window)
    expected = reference_order(starts, lengths, seed, 2, window)
    size = len(expected)
    asked = [order.ranges([(a, min(a + step, size))]) for a in range(0, size, step)]
    assert [r for piece in asked for r in piece] == expected
    # Far apart and backwards: spans evicted from the cache come back the same.
    for a in reversed(range(0, size, step)):
        assert order.ranges([(a, min(a + step, size))]) == expected[a : a + step]


def test_without_a_window_each_block_is_read_front_to_back_and_epochs_differ() -> None:
    starts, lengths = blocks([10, 7, 12], 4)
    first = BlockOrder(starts, lengths, seed=3, epoch=0, shuffle=True, window=0).ranges([(0, 29)])
    second = BlockOrder(starts, lengths, seed=3, epoch=1, shuffle=True, window=0).ranges([(0, 29)])
    assert first != second
    at = 0
    runs: list[list[int]] = []
    while at < len(first):
        end = at + 1
        while end < len(first) and first[end] == first[end - 1] + 1:
            end += 1
        runs.append(first[at:end])
        at = end
    # Runs of consecutive records: whole blocks (or adjacent blocks of a file).
    assert all(len(run) >= min(lengths.tolist()) for run in runs)
    assert len(runs) <= len(starts)


def test_following_names_the_blocks_visited_next() -> None:
    starts, lengths = blocks([8, 8], 4)
    order = BlockOrder(starts, lengths, seed=1, epoch=0, shuffle=True, window=0)
    visited = order.ranges([(0, 16)])
    firsts = visited[::4]  # a block's first record, in the order visited
    assert order.following(firsts[0], 2) == firsts[1:3]
    assert order.following(firsts[-1] + 3, 1) == []


@settings(max_examples=150, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda c: sum(c) > 0),
    block=st.integers(1, 9),
    window=st.integers(0, 30),
    seed=st.integers(0, 2**40),
    shuffle=st.booleans(),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_a_batch_in_read_order_holds_its_records_sorted_by_block_then_offset(
    counts: list[int], block: int, window: int, seed: int, shuffle: bool, cuts: list[int]
) -> None:
    starts, lengths = blocks(counts, block)
    size = sum(counts)
    order = BlockOrder(starts, lengths, seed, 1, shuffle, window)
    edges = sorted({0, size, *(c % (size + 1) for c in cuts)})
    runs = list(itertools.pairwise(edges))[::-1]  # segments come in any order
    records = order.in_read_order(runs).tolist()
    assert sorted(records) == sorted(order.ranges(runs))
    # Where each record is read: its block's turn in the epoch, then its
    # offset in the block (the order without a window); every other shuffle
    # window is taken backwards.
    visited = BlockOrder(starts, lengths, seed, 1, shuffle, 0).ranges([(0, size)])
    read = {r: p for p, r in enumerate(visited)}
    span = window if shuffle and window > 1 else size
    keys = [(read[r] // span, read[r] if read[r] // span % 2 == 0 else -read[r]) for r in records]
    assert keys == sorted(keys)
