"""The watchdog's learned bound (dlfleet.worker.agent.watchdog), by properties
over random write histories, against a model kept by hand."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.worker.agent.watchdog import CATCH_UP_S, WARMUP_WRITES, Bounds, StepPace

gaps = st.lists(st.floats(min_value=0.01, max_value=30.0), min_size=0, max_size=40)
bounds = st.builds(
    lambda ceiling, factor, floor_share: Bounds(ceiling, factor, max(0.01, ceiling * floor_share)),
    st.floats(min_value=0.5, max_value=600.0),
    st.one_of(st.just(0.0), st.floats(min_value=2.0, max_value=20.0)),
    st.floats(min_value=0.001, max_value=1.0),
)


def feed(pace: StepPace, start: float, history: list[float]) -> float:
    now = start
    pace.saw(now)
    for gap in history:
        now += gap
        pace.saw(now)
        pace.saw(now)  # the same write seen again by a later poll: nothing new
    return now


@given(bounds, gaps)
def test_the_bound_is_the_ceiling_until_enough_gaps_are_learned_then_factor_x_longest(
    b: Bounds, history: list[float]
) -> None:
    pace = StepPace(b)
    feed(pace, 1000.0, history)
    if b.factor == 0 or len(history) < WARMUP_WRITES:
        assert pace.limit() == b.ceiling
    else:
        expected = min(b.ceiling, max(b.floor, b.factor * max(history)))
        assert pace.limit() == pytest.approx(expected)
        assert b.floor <= pace.limit() <= b.ceiling


@given(bounds, gaps, st.floats(min_value=0.0, max_value=1.0))
def test_a_rank_as_slow_as_it_ever_was_is_never_called_hung(
    b: Bounds, history: list[float], share: float
) -> None:
    """Safety: once a gap as long as the longest seen is in, a file that old
    (or younger) is within the bound, however the history went."""
    pace = StepPace(b)
    feed(pace, 0.0, history)
    longest = max(history, default=0.0)
    assert share * min(longest, b.ceiling) <= pace.limit()


@given(bounds, gaps, gaps)
def test_the_bound_never_shrinks_within_a_round(
    b: Bounds, first: list[float], second: list[float]
) -> None:
    pace = StepPace(b)
    now = feed(pace, 0.0, first)
    before = pace.limit()
    feed(pace, now + 0.5, second)
    learned_before = b.factor != 0 and len(first) >= WARMUP_WRITES
    if learned_before:
        assert pace.limit() >= before


def test_time_off_the_watch_is_not_a_gap() -> None:
    """progress.idle() removes the file (evaluation, an epoch's end): the
    time until the next write is not learned as a step's gap."""
    pace = StepPace(Bounds(ceiling=300.0, factor=4.0, floor=1.0))
    now = feed(pace, 0.0, [0.5] * WARMUP_WRITES)
    assert pace.limit() == pytest.approx(2.0)
    pace.saw(None)  # idle for a minute
    pace.saw(now + 60.0)
    pace.saw(now + 60.5)
    assert pace.limit() == pytest.approx(2.0)


def test_a_learned_bound_catches_a_hang_long_before_the_ceiling() -> None:
    pace = StepPace(Bounds(ceiling=300.0, factor=4.0, floor=2.0))
    feed(pace, 0.0, [0.55, 0.6, 0.52, 0.7, 0.5, 0.51, 0.58, 0.6])
    assert pace.limit() == pytest.approx(2.8)
    assert not pace.learning()


@pytest.mark.parametrize(
    ("ceiling", "factor", "floor", "words"),
    [
        (0.0, 4.0, 1.0, "step timeout must be > 0"),
        (10.0, 1.5, 1.0, "factor must be 0 (off) or >= 2"),
        (10.0, 4.0, 11.0, "floor must be in (0, 10]"),
        (10.0, 4.0, 0.0, "floor must be in (0, 10]"),
    ],
)
def test_bad_bounds_are_refused_naming_the_value(
    ceiling: float, factor: float, floor: float, words: str
) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Bounds(ceiling, factor, floor)


def test_a_gap_while_the_master_was_away_is_not_learned() -> None:
    """Saves and leases may wait for a master that restarts: that is not the
    job's pace, and learning it would leave later hangs to the ceiling."""
    pace = StepPace(Bounds(ceiling=5.0, factor=4.0, floor=2.0))
    now = feed(pace, 0.0, [0.6] * WARMUP_WRITES)
    assert pace.limit() == pytest.approx(2.4)
    pace.saw(now + 1.9, excused_at=now + 0.7)  # the master was away within the gap
    assert pace.limit() == pytest.approx(2.4)
    pace.saw(now + 3.0, excused_at=now + 0.7)  # the next gap began after it: learned
    assert pace.limit() == pytest.approx(4.4)


def test_after_the_master_was_away_only_the_ceiling_judges_for_a_while() -> None:
    """A save waits for the master to commit its step once it answers again
    (the keeper's bounds): the learned bound must not call that wait a hang
    (a chaos run saw it once: 0.7 s, right after a master restart)."""
    pace = StepPace(Bounds(ceiling=5.0, factor=4.0, floor=0.5))
    feed(pace, 0.0, [0.15] * WARMUP_WRITES)
    assert pace.limit() == pytest.approx(0.6)
    assert pace.limit(since_master_away=0.5) == 5.0
    assert pace.limit(since_master_away=CATCH_UP_S - 0.1) == 5.0
    assert pace.limit(since_master_away=CATCH_UP_S) == pytest.approx(0.6)
