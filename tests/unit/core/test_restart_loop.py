"""The restart-loop breaker as a pure core: strikes, the ceiling, the verdict."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.restart_loop import (
    NONE,
    BreakerEvent,
    BreakerSettings,
    RestartLoopBreaker,
    RestartLoopBroken,
)


def held(steps: set[int]) -> Callable[[int], bool]:
    return lambda step: any(s < step for s in steps)


def fail_round(
    breaker: RestartLoopBreaker,
    round_: int,
    restored: int,
    reached: int = NONE,
    steps: frozenset[int] = frozenset({10, 20, 30}),
    message: str = "ValueError: loss is NaN",
) -> list[BreakerEvent]:
    events = breaker.restored(round_, restored)
    return events + breaker.failed(
        round_, reached, message, [f"train records {round_}..{round_ + 8}"], held(set(steps))
    )


def test_k_failures_after_restoring_the_same_step_lower_the_ceiling_to_it() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=2, window=1))
    fail_round(breaker, 1, 30)
    assert breaker.ceiling is None
    fail_round(breaker, 2, 30, reached=31)
    assert breaker.ceiling == 30
    assert breaker.below(0) == 30
    assert breaker.below(25) == 25
    assert breaker.below(40) == 30


def test_progress_beyond_the_window_forgets_the_strikes() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=2, window=1))
    fail_round(breaker, 1, 30)
    fail_round(breaker, 2, 30, reached=32)  # it got past the failing step
    fail_round(breaker, 3, 30)
    assert breaker.ceiling is None


def test_committed_progress_past_the_ceiling_lifts_it() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=1, window=1))
    fail_round(breaker, 1, 30)
    assert breaker.ceiling == 30
    breaker.restored(2, 20)
    breaker.progress(2, 25)  # beyond 20 + 1, not beyond the ceiling's window
    assert breaker.ceiling == 30
    breaker.progress(3, 40)  # round 3 restored nothing known: no word
    breaker.restored(3, 20)
    breaker.progress(3, 32)
    assert breaker.ceiling is None


def test_the_ladder_ends_in_a_diagnosis_naming_step_leases_and_last_error() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=2, window=0))
    round_ = 0
    for step in (30, 20, 10):
        for _ in range(2):
            round_ += 1
            fail_round(breaker, round_, step, message=f"boom {round_}")
    diagnosis = breaker.broken
    assert diagnosis is not None
    assert diagnosis.step == 10
    assert [s.round for s in diagnosis.strikes] == [5, 6]
    words = diagnosis.describe()
    assert "after restoring step 10" in words
    assert "train records 5..13" in words and "train records 6..14" in words
    assert "boom 6" in words
    with pytest.raises(RestartLoopBroken, match="restart loop"):
        breaker.check_open()


def test_a_loop_at_a_fresh_start_fails_the_job() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=2))
    fail_round(breaker, 1, NONE)
    fail_round(breaker, 2, NONE)
    assert breaker.broken is not None and breaker.broken.step == NONE
    assert "from a fresh start" in breaker.broken.describe()


def test_a_round_counts_once_however_many_ranks_report_it() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=2))
    fail_round(breaker, 1, 30)
    fail_round(breaker, 1, 30)
    assert breaker.ceiling is None


def test_a_round_that_never_asked_for_a_checkpoint_is_no_strike() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=1))
    assert breaker.failed(1, NONE, "x", [], held({10})) == []
    assert breaker.broken is None and breaker.ceiling is None


def test_off_with_zero_failures() -> None:
    breaker = RestartLoopBreaker(BreakerSettings(failures=0))
    for round_ in range(1, 10):
        fail_round(breaker, round_, 30)
    assert breaker.broken is None and breaker.ceiling is None


def test_settings_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="window"):
        BreakerSettings(window=-1)


ROUNDS = st.lists(
    st.tuples(st.sampled_from([NONE, 0, 10, 20, 30]), st.integers(-1, 40), st.booleans()),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ROUNDS, st.integers(1, 3), st.integers(0, 3))
def test_replaying_or_installing_rebuilds_the_state_and_the_loop_ends(
    rounds: list[tuple[int, int, bool]], failures: int, window: int
) -> None:
    config = BreakerSettings(failures=failures, window=window)
    live = RestartLoopBreaker(config)
    journal: list[str] = []
    steps = {0, 10, 20, 30}
    for index, (step, reached, fails) in enumerate(rounds, start=1):
        restored = live.below(0)
        asked = max((s for s in steps if s < restored), default=NONE) if restored else step
        events = live.restored(index, asked)
        if fails:
            events += live.failed(index, reached, f"error {index}", [], held(steps))
        else:
            events += live.progress(index, reached)
        journal += [e.to_json() for e in events]
        ceiling = live.ceiling
        assert ceiling is None or ceiling > 0  # a ceiling always leaves a step below it
    replayed = RestartLoopBreaker(config)
    for text in journal:
        replayed.apply(BreakerEvent.from_json(text))
    assert replayed.to_dict() == live.to_dict()
    installed = RestartLoopBreaker(config)
    installed.install(json.loads(json.dumps(live.to_dict())))
    assert installed.to_dict() == live.to_dict()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), st.lists(st.integers(0, 100), max_size=6))
def test_a_job_failing_after_every_restore_ends_within_k_rounds_per_step(
    failures: int, window: int, saved: list[int]
) -> None:
    """Every round restores the newest step under the ceiling and fails
    right after it: the job is broken after at most K rounds per step held
    (and K more at the bottom), never looping."""
    steps = set(saved)
    breaker = RestartLoopBreaker(BreakerSettings(failures=failures, window=window))
    bound = failures * (len(steps) + 1)
    for round_ in range(1, bound + 1):
        ceiling = breaker.below(0)
        restored = max((s for s in steps if not ceiling or s < ceiling), default=NONE)
        breaker.restored(round_, restored)
        breaker.failed(round_, restored, "boom", [], held(steps))
        if breaker.broken is not None:
            break
    assert breaker.broken is not None
