"""The slot policy that a rank's writer and the agent's replicas share."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlfleet.worker.checkpoint.errors import SlotError
from dlfleet.worker.checkpoint.slots import Held, choose, slot_count


@given(
    slots=st.integers(2, 8),
    lags=st.lists(st.integers(0, 10), min_size=1, max_size=60),
    resaves=st.lists(st.booleans(), min_size=60, max_size=60),
)
def test_saves_whose_answers_trail_keep_every_restorable_image(
    slots: int, lags: list[int], resaves: list[bool]
) -> None:
    """Steps saved in order (sometimes the same step again), the protected
    step trailing the newest by `lag`: a choice with room replaces nothing
    from the protected step on, nor the newest image; the protected step is
    never replaced; no more than `slots` slots are used; and while the
    answers trail by at most slots - 2 steps there is always room."""
    held: dict[int, Held] = {}
    step, keep_from = 0, -1
    for lag, resave in zip(lags, resaves, strict=False):
        if not (resave and held):
            step += 1
        keep_from = max(keep_from, step - 1 - lag) if step > 1 else -1
        protected = keep_from if any(h.step == keep_from for h in held.values()) else None
        if protected == step:
            continue  # the writer refuses to rewrite the protected step
        slot, room = choose(list(held.values()), slots, step=step, keep_from=keep_from)
        assert 0 <= slot < slots
        replaced = held.get(slot)
        newest = max(held.values(), key=lambda h: (h.round, h.step), default=None)
        if replaced is not None and replaced.step != step:
            assert replaced.step != protected
            if room:
                assert replaced.step < keep_from and replaced is not newest
        if lag <= slots - 2:
            assert room
        held[slot] = Held(slot, 0, step)
        assert len(held) <= slots


def test_without_commits_only_the_newest_image_is_kept() -> None:
    held = [Held(0, 0, 4), Held(1, 0, 5)]
    assert choose(held, 3, step=6, keep_from=None) == (0, True)
    assert choose([Held(0, 0, 5)], 1, step=6, keep_from=None) == (0, False)


def test_an_abandoned_round_is_replaced_step_by_step() -> None:
    """After a restore to step 3 the old round's newer steps repeat: each is
    replaced by the new round's image of the same step."""
    held = [Held(0, 1, 3), Held(1, 1, 4), Held(2, 1, 5)]
    assert choose(held, 3, step=4, keep_from=3) == (1, True)


def test_every_slot_holding_the_protected_step_is_an_error() -> None:
    with pytest.raises(SlotError, match="protected step 4"):
        choose([Held(0, 0, 4)], 1, step=5, keep_from=4)
    with pytest.raises(ValueError, match="at least one slot"):
        choose([], 0, step=1, keep_from=None)


@pytest.mark.parametrize(
    ("memory", "image", "expected"),
    [(None, 10, 8), (100, 10, 8), (100, 30, 3), (100, 90, 2), (100, 1000, 2), (100, 0, 8)],
)
def test_the_slot_count_follows_the_memory_bound(
    memory: int | None, image: int, expected: int
) -> None:
    assert slot_count(8, memory, image) == expected
