"""The fallback ladder as a pure function over candidates and their
verification results."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given
from hypothesis import strategies as st

from dlfleet.worker.checkpoint.ladder import (
    Candidate,
    Rejected,
    Rung,
    Skip,
    Verification,
    Verified,
    descend,
)

OWN = Candidate(Rung.SHARED_MEMORY, 100, "/dev/shm/dlfleet-ckpt-0")
PEER = Candidate(Rung.PEER_REPLICA, 100, "node-1#1")
PERSISTED = Candidate(Rung.PERSISTED, 90, "/ckpt/step-90")
OLDER = Candidate(Rung.OLDER_PERSISTED, 80, "/ckpt/step-80")
LADDER = [OLDER, PERSISTED, PEER, OWN]  # in no particular order


def verifier(
    results: dict[Candidate, Verification], asked: list[Candidate] | None = None
) -> Callable[[Candidate], Verification]:
    """`verify` over known results; a candidate without one is missing."""

    def verify(candidate: Candidate) -> Verification:
        if asked is not None:
            asked.append(candidate)
        return results.get(candidate, Rejected(Skip.MISSING))

    return verify


def test_an_intact_own_image_is_taken_and_nothing_else_is_read() -> None:
    asked: list[Candidate] = []
    descent = descend(LADDER, verifier({c: Verified() for c in LADDER}, asked))
    assert descent.chosen == OWN
    assert descent.passed == ()
    assert asked == [OWN]
    assert descent.describe() == "restoring step 100 from shared memory (/dev/shm/dlfleet-ckpt-0)"


def test_a_corrupt_own_image_falls_back_to_the_peer_replica_and_says_why() -> None:
    results: dict[Candidate, Verification] = {
        OWN: Rejected(Skip.CHECKSUM, "tensor model.weight, stripe 3"),
        PEER: Verified(),
        PERSISTED: Verified(),
    }
    descent = descend(LADDER, verifier(results))
    assert descent.chosen == PEER
    assert [(p.candidate, p.why) for p in descent.passed] == [(OWN, Skip.CHECKSUM)]
    assert descent.describe() == (
        "restoring step 100 from peer replica (node-1#1); passed over shared memory step 100 "
        "(/dev/shm/dlfleet-ckpt-0): checksum: tensor model.weight, stripe 3"
    )


def test_each_rung_passed_is_named_in_order_down_to_the_older_folders() -> None:
    results: dict[Candidate, Verification] = {
        PEER: Rejected(Skip.CHECKSUM),
        PERSISTED: Rejected(Skip.MISSING, "/ckpt/step-90/rank-1.bin truncated"),
        OLDER: Verified(),
    }
    descent = descend(LADDER, verifier(results))
    assert descent.chosen == OLDER
    assert [p.candidate for p in descent.passed] == [OWN, PEER, PERSISTED]
    assert [p.why for p in descent.passed] == [Skip.MISSING, Skip.CHECKSUM, Skip.MISSING]


def test_a_newer_step_in_a_replica_wins_over_an_older_own_image() -> None:
    newer_peer = Candidate(Rung.PEER_REPLICA, 120, "node-1#1")
    descent = descend([OWN, newer_peer], verifier({OWN: Verified(), newer_peer: Verified()}))
    assert descent.chosen == newer_peer


def test_another_models_checkpoint_is_passed_over_as_a_shape_mismatch() -> None:
    results: dict[Candidate, Verification] = {
        c: Rejected(Skip.SHAPE, "model.fc.weight: saved (10, 4), model (10, 8)") for c in LADDER
    }
    descent = descend(LADDER, verifier(results))
    assert descent.chosen is None
    assert all(p.why is Skip.SHAPE for p in descent.passed)
    assert descent.describe().startswith("no checkpoint verifies; passed over shared memory")


def test_the_breaker_asks_for_a_step_below_the_failing_one_without_reading_newer_ones() -> None:
    asked: list[Candidate] = []
    descent = descend(LADDER, verifier({c: Verified() for c in LADDER}, asked), below_step=100)
    assert descent.chosen == PERSISTED
    assert asked == [PERSISTED]
    assert [p.why for p in descent.passed] == [Skip.ABOVE_BREAKER, Skip.ABOVE_BREAKER]


def test_no_candidates_choose_nothing() -> None:
    assert descend([], verifier({})).chosen is None


candidates = st.lists(
    st.builds(
        Candidate,
        st.sampled_from(list(Rung)),
        st.integers(0, 5),
        st.sampled_from(["a", "b"]),
    ),
    unique=True,
    max_size=8,
)


@given(candidates, st.data(), st.one_of(st.none(), st.integers(0, 6)))
def test_the_choice_is_the_first_verifying_candidate_in_ladder_order(
    ladder: list[Candidate], data: st.DataObject, below: int | None
) -> None:
    outcomes: list[Verification] = [Verified(), Rejected(Skip.CHECKSUM)]
    results = {c: data.draw(st.sampled_from(outcomes)) for c in ladder}
    descent = descend(ladder, verifier(results), below_step=below)
    allowed = [c for c in ladder if below is None or c.step < below]
    good = [c for c in allowed if isinstance(results[c], Verified)]
    # Every candidate is either chosen, passed over, or never looked at
    # because something better verified first; none is passed twice.
    seen = [p.candidate for p in descent.passed]
    assert len(seen) == len(set(seen))
    if not good:
        assert descent.chosen is None
        assert set(seen) == set(ladder)
        return
    chosen = descent.chosen
    assert chosen is not None and chosen in good
    # Nothing newer, or as new and nearer, verified.
    for other in good:
        assert (other.step, -other.rung.order) <= (chosen.step, -chosen.rung.order)
    # Everything passed over ranks above the choice.
    for passed in seen:
        assert (passed.step, -passed.rung.order) >= (chosen.step, -chosen.rung.order)
