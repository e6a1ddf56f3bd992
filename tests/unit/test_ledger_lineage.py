"""The exactly-once checker of the end-to-end tests (tests/e2e/ledger.py), on
hand-written ledgers: what counts in the final lineage, and what it reports."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from e2e.ledger import (
    Entry,
    Restore,
    assert_exactly_once,
    check,
    drop_last_length,
    expected_ids,
    final_lineage,
)

from dlfleet.api.permutation import EpochPermutation

SIZE = 8


class Ledger:
    """Writes ledger files the way ledger_train.py does."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def step(
        self, attempt: int, step: int, epoch: int, ids_per_rank: Sequence[Sequence[int]]
    ) -> None:
        world = len(ids_per_rank)
        for rank, ids in enumerate(ids_per_rank):
            line = {
                "attempt": attempt, "round": attempt, "restart": 0, "rank": rank,
                "world": world, "epoch": epoch, "step": step, "ids": list(ids),
            }  # fmt: skip
            with (self.dir / f"ledger-a{attempt}-r{rank}.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")

    def restore(self, attempt: int, restored_step: int) -> None:
        line = {"attempt": attempt, "round": attempt, "restart": 0, "restored_step": restored_step}
        with (self.dir / "restores.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def clean_epochs(self, attempt: int = 1, epochs: int = 2, first_step: int = 1) -> int:
        """Every record once per epoch, two ranks of two records a step; returns
        the next step."""
        step = first_step
        for epoch in range(epochs):
            for start in range(0, SIZE, 4):
                self.step(attempt, step, epoch, [[start, start + 1], [start + 2, start + 3]])
                step += 1
        return step


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path)


def test_every_record_once_per_epoch_passes(ledger: Ledger) -> None:
    ledger.restore(1, 0)
    ledger.clean_epochs()
    report = assert_exactly_once(ledger.dir, size=SIZE, epochs=2)
    assert (report.entries, report.counted, report.discarded) == (8, 8, 0)
    assert [e.trained for e in report.epochs] == [SIZE, SIZE]


def test_a_record_trained_twice_in_an_epoch_fails_naming_it(ledger: Ledger) -> None:
    ledger.clean_epochs(epochs=1)
    ledger.step(1, 3, 0, [[5], [7]])
    report = check(ledger.dir, size=SIZE, epochs=1)
    assert not report.ok
    assert report.epochs[0].duplicates == {5: 2, 7: 2}
    with pytest.raises(AssertionError, match=r"duplicates \(id: times\): 5: 2, 7: 2"):
        assert_exactly_once(ledger.dir, size=SIZE, epochs=1)


def test_a_record_never_trained_fails_naming_it(ledger: Ledger) -> None:
    ledger.step(1, 1, 0, [[0, 1], [2, 3]])
    ledger.step(1, 2, 0, [[4, 5], [6]])
    report = check(ledger.dir, size=SIZE, epochs=1)
    assert report.epochs[0].missing == (7,)
    assert "missing (1): [7]" in report.summary()


def test_a_whole_epoch_missing_fails(ledger: Ledger) -> None:
    ledger.clean_epochs(epochs=1)
    report = check(ledger.dir, size=SIZE, epochs=2)
    assert report.epochs[0].ok
    assert report.epochs[1].missing == tuple(range(SIZE))


def test_a_record_outside_the_epoch_is_unexpected(ledger: Ledger) -> None:
    ledger.clean_epochs(epochs=1)
    ledger.step(1, 3, 0, [[SIZE], [SIZE + 1]])
    assert check(ledger.dir, size=SIZE, epochs=1).epochs[0].unexpected == (SIZE, SIZE + 1)


def test_a_restore_discards_the_steps_after_it_of_earlier_attempts(ledger: Ledger) -> None:
    ledger.restore(1, 0)
    ledger.step(1, 1, 0, [[0, 1], [2, 3]])
    ledger.step(1, 2, 0, [[4, 5], [6, 7]])  # trained, then rolled back
    ledger.step(1, 3, 1, [[3, 2], [1, 0]])  # rolled back too (another epoch)
    # Attempt 2 resumes from the checkpoint of step 1 and trains 2.. again.
    ledger.restore(2, 1)
    ledger.step(2, 2, 0, [[7, 6], [5, 4]])
    ledger.step(2, 3, 1, [[0, 1], [2, 3]])
    ledger.step(2, 4, 1, [[4, 5], [6, 7]])
    report = assert_exactly_once(ledger.dir, size=SIZE, epochs=2)
    assert (report.counted, report.discarded) == (8, 4)
    assert report.attempts == (1, 2)


def test_without_the_restore_the_same_ledger_has_duplicates(ledger: Ledger) -> None:
    ledger.step(1, 1, 0, [[0, 1], [2, 3]])
    ledger.step(1, 2, 0, [[4, 5], [6, 7]])
    ledger.step(2, 1, 0, [[4, 5], [6, 7]])
    assert check(ledger.dir, size=SIZE, epochs=1).epochs[0].duplicates == {4: 2, 5: 2, 6: 2, 7: 2}


def test_the_restored_step_itself_counts_from_the_earlier_attempt(ledger: Ledger) -> None:
    ledger.restore(1, 0)
    ledger.step(1, 1, 0, [[0, 1], [2, 3]])
    ledger.step(1, 2, 0, [[4, 5], [6, 7]])  # checkpointed after this step
    ledger.step(1, 3, 1, [[0, 1], [2, 3]])  # the crash came during this one
    ledger.restore(2, 2)
    ledger.step(2, 3, 1, [[7, 6], [5, 4]])
    ledger.step(2, 4, 1, [[3, 2], [1, 0]])
    report = assert_exactly_once(ledger.dir, size=SIZE, epochs=2)
    assert (report.counted, report.discarded) == (8, 2)


def test_a_later_restore_further_back_discards_across_several_attempts(ledger: Ledger) -> None:
    entries = [
        Entry(attempt=1, rank=0, world=1, epoch=0, step=s, ids=(s,)) for s in range(1, 6)
    ] + [Entry(attempt=2, rank=0, world=1, epoch=0, step=s, ids=(s,)) for s in range(4, 8)]
    restores = [Restore(1, 0), Restore(2, 3), Restore(3, 2)]
    counted, discarded = final_lineage(entries, restores)
    assert [(e.attempt, e.step) for e in counted] == [(1, 1), (1, 2)]
    assert len(discarded) == 7


def test_a_restore_never_discards_its_own_attempt(ledger: Ledger) -> None:
    entries = [Entry(attempt=2, rank=0, world=1, epoch=0, step=s, ids=(s,)) for s in (4, 5)]
    counted, discarded = final_lineage(entries, [Restore(2, 3)])
    assert len(counted) == 2 and not discarded


def test_replays_across_attempts_pass_only_when_allowed(ledger: Ledger) -> None:
    # No checkpoints: attempt 1 trained 0-3 and crashed before the master knew;
    # attempt 2 (steps from 1 again) trains all of the epoch.
    ledger.step(1, 1, 0, [[0, 1], [2, 3]])
    ledger.clean_epochs(attempt=2, epochs=1)
    assert check(ledger.dir, size=SIZE, epochs=1).epochs[0].duplicates == {0: 2, 1: 2, 2: 2, 3: 2}
    report = assert_exactly_once(ledger.dir, size=SIZE, epochs=1, allow_replay=True)
    assert report.replayed == 4
    assert report.epochs[0].replayed == {0: 2, 1: 2, 2: 2, 3: 2}


def test_a_duplicate_within_one_attempt_fails_even_when_replays_are_allowed(
    ledger: Ledger,
) -> None:
    ledger.clean_epochs(epochs=1)
    ledger.step(1, 3, 0, [[0], [1]])
    report = check(ledger.dir, size=SIZE, epochs=1, allow_replay=True)
    assert report.epochs[0].duplicates == {0: 2, 1: 2}


def test_a_counted_step_missing_a_rank_is_a_problem(ledger: Ledger) -> None:
    ledger.restore(1, 0)
    ledger.step(1, 1, 0, [[0, 1], [2, 3]])
    ledger.step(1, 2, 0, [[4, 5], [6, 7]])
    (ledger.dir / "ledger-a1-r1.jsonl").write_text(
        (ledger.dir / "ledger-a1-r1.jsonl").read_text().splitlines()[0] + "\n"
    )
    report = check(ledger.dir, size=SIZE, epochs=1)
    assert "step 2 of attempt 1 counts, but ranks [1] never logged it" in report.problems


def test_a_step_counted_from_two_attempts_is_a_problem(ledger: Ledger) -> None:
    ledger.restore(1, 0)
    ledger.step(1, 1, 0, [[0, 1], [2, 3]])
    ledger.restore(2, 1)
    ledger.step(2, 1, 0, [[4, 5], [6, 7]])
    report = check(ledger.dir, size=SIZE, epochs=1)
    assert "step 1 counts from several attempts [1, 2]" in report.problems


def test_a_torn_last_line_is_ignored_but_a_torn_middle_line_is_a_problem(ledger: Ledger) -> None:
    ledger.clean_epochs(epochs=1)
    path = ledger.dir / "ledger-a1-r0.jsonl"
    with path.open("a") as f:
        f.write('{"attempt": 1, "rank": 0, "wor')  # killed inside write()
    assert check(ledger.dir, size=SIZE, epochs=1).ok
    with path.open("a") as f:
        f.write("\n")
    assert "ledger-a1-r0.jsonl:3: not JSON" in check(ledger.dir, size=SIZE, epochs=1).summary()


def test_drop_last_expects_the_first_positions_of_each_epochs_permutation(ledger: Ledger) -> None:
    size, global_batch = 11, 4
    length = drop_last_length(size, global_batch)
    assert length == 8
    for epoch in range(2):
        permutation = EpochPermutation(size, 0, epoch)
        kept = [permutation[p] for p in range(length)]
        assert expected_ids(size, epoch, epoch_length=length) == set(kept)
        for i in range(0, length, 4):
            ledger.step(1, epoch * 2 + i // 4 + 1, epoch, [kept[i : i + 2], kept[i + 2 : i + 4]])
    report = assert_exactly_once(ledger.dir, size=size, epochs=2, drop_last_global_batch=4)
    assert [e.expected for e in report.epochs] == [8, 8]
    # Checked without drop_last, the dropped records are missing.
    assert len(check(ledger.dir, size=size, epochs=2).epochs[0].missing) == 3


def test_entries_of_an_epoch_beyond_the_last_are_a_problem(ledger: Ledger) -> None:
    ledger.clean_epochs(epochs=2)
    report = check(ledger.dir, size=SIZE, epochs=1)
    assert "4 entries of epoch 1, beyond the 1 epochs" in report.problems
