"""IntervalSet against a plain Python set of positions: every operation keeps
the two equal, and the ranges stay sorted, disjoint and merged."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import given, settings

from dlfleet.master.core.intervals import IntervalSet

LIMIT = 64
POINT = st.integers(-4, LIMIT + 4)
SPAN = st.tuples(POINT, POINT)
OPS = st.lists(st.tuples(st.sampled_from(["add", "remove"]), SPAN), max_size=30)
NONEMPTY_SPAN = st.tuples(POINT, st.integers(1, 20)).map(lambda t: (t[0], t[0] + t[1]))

FAST = settings(max_examples=75, deadline=None)


def positions(s: IntervalSet) -> set[int]:
    return {p for start, end in s for p in range(start, end)}


def build(ops: list[tuple[str, tuple[int, int]]]) -> tuple[IntervalSet, set[int]]:
    s, model = IntervalSet(), set[int]()
    for op, (start, end) in ops:
        if op == "add":
            s.add(start, end)
            model |= set(range(start, end))
        else:
            s.remove(start, end)
            model -= set(range(start, end))
        assert_canonical(s)
        assert positions(s) == model
    return s, model


def assert_canonical(s: IntervalSet) -> None:
    """Sorted, non-empty, disjoint, and merged: no two ranges touch."""
    ranges = list(s)
    assert all(start < end for start, end in ranges)
    for (_, end), (next_start, _) in itertools.pairwise(ranges):
        assert end < next_start, f"ranges touch or overlap: {ranges}"
    assert len(s) == len(ranges)
    assert bool(s) == bool(ranges)


@FAST
@given(ops=OPS)
def test_add_and_remove_match_a_set_of_positions_and_keep_ranges_merged(
    ops: list[tuple[str, tuple[int, int]]],
) -> None:
    build(ops)


@FAST
@given(ops=OPS)
def test_total_counts_the_positions(ops: list[tuple[str, tuple[int, int]]]) -> None:
    s, model = build(ops)
    assert s.total() == len(model)


@FAST
@given(ops=OPS)
def test_first_is_the_lowest_maximal_run(ops: list[tuple[str, tuple[int, int]]]) -> None:
    s, model = build(ops)
    first = s.first()
    if not model:
        assert first is None
        return
    assert first is not None
    low = min(model)
    high = low
    while high in model:
        high += 1
    assert first == (low, high)


@FAST
@given(ops=OPS, query=NONEMPTY_SPAN)
def test_covers_means_every_position_of_the_range_is_in(
    ops: list[tuple[str, tuple[int, int]]], query: tuple[int, int]
) -> None:
    s, model = build(ops)
    assert s.covers(*query) == set(range(*query)).issubset(model)


@FAST
@given(ops=OPS, query=NONEMPTY_SPAN)
def test_overlaps_means_some_position_of_the_range_is_in(
    ops: list[tuple[str, tuple[int, int]]], query: tuple[int, int]
) -> None:
    s, model = build(ops)
    assert s.overlaps(*query) == bool(set(range(*query)) & model)


@FAST
@given(ops=OPS, query=SPAN)
def test_complement_is_the_positions_of_the_range_not_in_the_set(
    ops: list[tuple[str, tuple[int, int]]], query: tuple[int, int]
) -> None:
    s, model = build(ops)
    gaps = s.complement(*query)
    assert_canonical(gaps)
    assert positions(gaps) == set(range(*query)) - model


@FAST
@given(ops=OPS)
def test_constructing_from_its_own_ranges_gives_an_equal_set(
    ops: list[tuple[str, tuple[int, int]]],
) -> None:
    s, _ = build(ops)
    copy = IntervalSet(s)
    assert copy == s
    copy.add(LIMIT + 10, LIMIT + 11)
    assert copy != s, "a copy must not share storage with the original"


@FAST
@given(spans=st.lists(SPAN, max_size=20), data=st.data())
def test_equal_position_sets_give_equal_interval_sets_whatever_the_insertion_order(
    spans: list[tuple[int, int]], data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(spans))
    assert IntervalSet(spans) == IntervalSet(shuffled)


def test_touching_ranges_merge_into_one() -> None:
    s = IntervalSet([(0, 5), (10, 15)])
    s.add(5, 10)
    assert list(s) == [(0, 15)]


def test_removing_the_middle_splits_a_range() -> None:
    s = IntervalSet([(0, 10)])
    s.remove(3, 6)
    assert list(s) == [(0, 3), (6, 10)]


def test_empty_and_inverted_ranges_are_no_ops() -> None:
    s = IntervalSet([(0, 10)])
    s.add(20, 20)
    s.add(30, 25)
    s.remove(5, 5)
    s.remove(8, 2)
    assert list(s) == [(0, 10)]


def test_iteration_is_a_snapshot_safe_against_mutation() -> None:
    s = IntervalSet([(0, 2), (4, 6), (8, 10)])
    seen = []
    for start, end in s:
        s.remove(start, end)
        seen.append((start, end))
    assert seen == [(0, 2), (4, 6), (8, 10)]
    assert not s


def test_interval_sets_are_unhashable() -> None:
    assert IntervalSet.__hash__ is None
