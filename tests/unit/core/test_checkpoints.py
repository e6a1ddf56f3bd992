"""CheckpointTable: a step is committed once every rank saved its image and
restorable while every rank has a copy on a live node; rounds fence each
other's steps; node losses and drops remove copies; the table is bounded; bad
input is refused and changes nothing; the journal replays to the same state."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dlfleet.api.errors import InvalidArgument
from dlfleet.master.core.checkpoint_events import (
    CheckpointEvent,
    ImageCopy,
    NodeGone,
    StepDropped,
    StepsAbandoned,
)
from dlfleet.master.core.checkpoints import (
    NONE,
    CheckpointReport,
    CheckpointSettings,
    CheckpointTable,
    PersistedStep,
)


def own(rank: int, node: str, size: int = 100) -> ImageCopy:
    return ImageCopy(rank, node, f"{node}:7000", replica=False, size=size)


def replica(rank: int, node: str, size: int = 100) -> ImageCopy:
    return ImageCopy(rank, node, f"{node}:7000", replica=True, size=size)


def report(
    node: str,
    step: int,
    copies: Sequence[ImageCopy],
    *,
    round_: int = 1,
    world: int = 2,
    dropped_below: int = 0,
    earlier: Sequence[int] = (),
) -> CheckpointReport:
    return CheckpointReport(node, step, round_, world, tuple(copies), dropped_below, tuple(earlier))


def save(
    table: CheckpointTable, step: int, *, round_: int = 1, world: int = 2
) -> list[CheckpointEvent]:
    """Every rank r of the round on node n{r}, replicated to the next node."""
    events: list[CheckpointEvent] = []
    for rank in range(world):
        copies = [own(rank, f"n{rank}"), replica((rank - 1) % world, f"n{rank}")]
        events += table.report(report(f"n{rank}", step, copies, round_=round_, world=world))[1]
    return events


def replayed(events: Sequence[CheckpointEvent], settings: CheckpointSettings) -> CheckpointTable:
    fresh = CheckpointTable(settings)
    for event in events:
        fresh.apply(CheckpointEvent.from_json(event.to_json()))
    return fresh


# ------------------------------------------------------------- commit rules


def test_a_step_is_committed_only_once_every_rank_saved_its_own_image() -> None:
    table = CheckpointTable()
    answer, _ = table.report(report("n0", 10, [own(0, "n0")]))
    assert answer.committed_step == NONE
    assert table.latest() is None
    answer, _ = table.report(report("n1", 10, [own(1, "n1")]))
    assert answer.committed_step == 10
    latest = table.latest()
    assert latest is not None and (latest.step, latest.round, latest.world_size) == (10, 1, 2)


def test_a_replica_counts_as_its_ranks_save_so_a_survivor_alone_can_commit_a_step() -> None:
    """The double fault: n1 saved step 10 and copied it to n0 while the
    master was away, then n1 was lost. n0's own image and its replica of
    n1's make step 10 committed and restorable from n0 alone."""
    table = CheckpointTable()
    save(table, 5)
    answer, _ = table.report(report("n0", 10, [own(0, "n0")]))
    assert answer.committed_step == 5
    table.node_gone("n1")
    answer, _ = table.report(report("n0", 10, [replica(1, "n0")]))
    assert answer.committed_step == 10
    latest = table.latest()
    assert latest is not None and latest.step == 10
    assert [(c.rank, c.node_id, c.replica) for c in latest.copies] == [
        (0, "n0", False),
        (1, "n0", True),
    ]
    # Rank 0's image is on n0 only: losing n0 would lose it, so not replicated.
    assert answer.replicated_step == 5


def test_a_replica_alone_of_one_rank_commits_nothing() -> None:
    table = CheckpointTable()
    answer, _ = table.report(report("n0", 10, [replica(1, "n0")]))
    assert answer.committed_step == NONE and table.latest() is None


def test_a_step_is_replicated_once_every_ranks_image_is_also_on_a_second_node() -> None:
    table = CheckpointTable()
    table.report(report("n0", 10, [own(0, "n0")]))
    answer, _ = table.report(report("n1", 10, [own(1, "n1")]))
    assert (answer.committed_step, answer.replicated_step) == (10, NONE)
    answer, _ = table.report(report("n1", 10, [replica(0, "n1")]))
    assert answer.replicated_step == NONE  # rank 1's image is on n1 only
    answer, _ = table.report(report("n0", 10, [replica(1, "n0")]))
    assert answer.replicated_step == 10
    assert table.status().replicated_step == 10
    # Losing a node later does not undo it (like a commit), and the snapshot keeps it.
    table.node_gone("n1")
    installed = CheckpointTable()
    installed.install(table.to_dict())
    assert installed.replicated_step() == 10


def test_a_step_saved_on_one_node_needs_no_replica_to_count_as_replicated() -> None:
    table = CheckpointTable()
    answer, _ = table.report(report("n0", 3, [own(0, "n0"), own(1, "n0")]))
    assert (answer.committed_step, answer.replicated_step) == (3, 3)


def test_latest_lists_each_ranks_own_copies_before_its_replicas() -> None:
    table = CheckpointTable()
    save(table, 5)
    latest = table.latest()
    assert latest is not None
    assert [(c.rank, c.replica, c.node_id) for c in latest.copies] == [
        (0, False, "n0"),
        (0, True, "n1"),
        (1, False, "n1"),
        (1, True, "n0"),
    ]


def test_latest_is_the_newest_restorable_step_and_before_step_looks_further_back() -> None:
    table = CheckpointTable()
    for step in (10, 20, 30):
        save(table, step)
    table.report(report("n0", 40, [own(0, "n0")]))  # not committed
    assert [v.step for v in [table.latest(), table.latest(30), table.latest(11)] if v] == [
        30,
        20,
        10,
    ]
    assert table.latest(10) is None


def test_a_report_names_earlier_steps_so_nodes_reporting_different_newest_steps_commit() -> None:
    """Reports trail the saves and carry each node's newest step: n0's is 7,
    n1's 5. The earlier steps each names make step 5 committed, the newest
    both hold; n1's next report commits 7."""
    table = CheckpointTable()
    table.report(report("n0", 7, [own(0, "n0")], earlier=[4, 5, 6]))
    answer, _ = table.report(report("n1", 5, [own(1, "n1")], earlier=[4]))
    assert answer.committed_step == 5
    answer, _ = table.report(report("n1", 8, [own(1, "n1")], earlier=[6, 7]))
    assert answer.committed_step == 7


def test_every_node_is_told_one_step_to_copy_until_it_is_replicated() -> None:
    """The replica step stays the one chosen while commits move on, so the
    nodes' replicas meet on it; once replicated, the newest committed step
    is chosen next."""
    table = CheckpointTable()
    table.report(report("n0", 3, [own(0, "n0")]))
    answer, _ = table.report(report("n1", 3, [own(1, "n1")]))
    assert (answer.committed_step, answer.replica_step) == (3, 3)
    table.report(report("n0", 5, [own(0, "n0")], earlier=[4]))
    answer, _ = table.report(report("n1", 5, [own(1, "n1")], earlier=[4]))
    assert (answer.committed_step, answer.replica_step) == (5, 3)
    table.report(report("n1", 3, [replica(0, "n1")]))
    answer, _ = table.report(report("n0", 3, [replica(1, "n0")]))
    assert (answer.replicated_step, answer.replica_step) == (3, 5)


def test_a_replica_step_never_replicated_is_given_up_for_a_newer_one() -> None:
    """A node that no longer holds the chosen step never copies it: after
    TARGET_PATIENCE reports the newest committed step is chosen instead."""
    from dlfleet.master.core.checkpoints import TARGET_PATIENCE

    table = CheckpointTable()
    save_own = [own(0, "n0")], [own(1, "n1")]
    table.report(report("n0", 1, save_own[0]))
    assert table.report(report("n1", 1, save_own[1]))[0].replica_step == 1
    answers = []
    for step in range(2, 2 + TARGET_PATIENCE):
        table.report(report("n0", step, save_own[0]))
        answers.append(table.report(report("n1", step, save_own[1]))[0].replica_step)
    assert answers[0] == 1 and answers[-1] > 1


def test_a_repeated_report_changes_nothing() -> None:
    table = CheckpointTable()
    save(table, 10)
    before = table.to_dict()
    answer, events = table.report(report("n0", 10, [own(0, "n0"), replica(1, "n0")]))
    assert (answer.committed_step, answer.stale, events) == (10, False, [])
    assert table.to_dict() == before


def test_a_report_updates_a_copy_it_names_again() -> None:
    table = CheckpointTable()
    save(table, 10)
    table.report(report("n0", 10, [own(0, "n0", size=999)]))
    assert table.status().bytes_held == 999 + 3 * 100


# -------------------------------------------------------------- node losses


def test_a_gone_node_takes_its_copies_and_a_step_without_a_copy_of_a_rank_is_not_restorable() -> (
    None
):
    table = CheckpointTable()
    save(table, 10)
    table.node_gone("n0")
    latest = table.latest()
    assert latest is not None, "rank 0's replica on n1 still covers it"
    assert {c.node_id for c in latest.copies} == {"n1"}
    table.node_gone("n1")
    assert table.latest() is None
    status = table.status()
    assert (status.committed_step, status.restorable_step, status.bytes_held) == (10, NONE, 0)


def test_copies_named_on_a_gone_node_are_not_recorded_and_its_own_reports_are_stale() -> None:
    table = CheckpointTable()
    table.node_gone("n1")
    answer, events = table.report(report("n1", 10, [own(1, "n1")]))
    assert answer.stale and events == []
    table.report(report("n0", 10, [own(0, "n0"), replica(1, "n1")]))
    assert table.status().bytes_held == 100


def test_node_gone_twice_is_one_event() -> None:
    table = CheckpointTable()
    save(table, 1)
    assert table.node_gone("n0") == [NodeGone("n0")]
    assert table.node_gone("n0") == []


def test_nodes_gone_except_drops_every_holder_that_is_not_live() -> None:
    table = CheckpointTable()
    save(table, 1, world=3)
    events = table.nodes_gone_except(["n1"])
    assert events == [NodeGone("n0"), NodeGone("n2")]
    assert table.latest() is None


def test_dropped_below_removes_the_reporters_copies_of_earlier_steps_only() -> None:
    table = CheckpointTable()
    for step in (10, 20, 30):
        save(table, step)
    table.report(report("n0", 30, [own(0, "n0")], dropped_below=30))
    held = {(s, c.node_id) for s, r in table.records.items() for c in r.copies()}
    assert held == {(10, "n1"), (20, "n1"), (30, "n0"), (30, "n1")}
    # n1 still holds rank 1's image and rank 0's replica of steps 10 and 20.
    latest = table.latest(30)
    assert latest is not None and {c.node_id for c in latest.copies} == {"n1"}
    table.report(report("n1", 30, [own(1, "n1")], dropped_below=30))
    assert table.latest(30) is None
    assert table.status().restorable_step == 30


# ----------------------------------------------------------------- lineage


def test_a_newer_round_abandons_older_rounds_steps_from_its_step_on() -> None:
    table = CheckpointTable()
    for step in (10, 20, 30):
        save(table, step, round_=1)
    _, events = table.report(report("n0", 20, [own(0, "n0")], round_=2))
    assert events[0] == StepsAbandoned(round=2, from_step=20)
    assert {s: r.round for s, r in table.records.items()} == {10: 1, 20: 2}
    latest = table.latest()
    assert latest is not None and (latest.step, latest.round) == (10, 1)


def test_a_report_of_an_older_round_than_the_steps_round_is_ignored() -> None:
    table = CheckpointTable()
    save(table, 10, round_=1)
    save(table, 20, round_=2)
    before = table.to_dict()
    answer, events = table.report(report("n0", 20, [own(0, "n0", size=5)], round_=1))
    assert (answer.stale, answer.committed_step, events) == (True, 20, [])
    assert table.to_dict() == before


def test_an_abandoned_step_cannot_come_back_through_a_late_report() -> None:
    table = CheckpointTable()
    save(table, 10, round_=1)
    save(table, 15, round_=2)
    for step in (12, 20):  # below and above round 2's step, both abandoned
        answer, events = table.report(report("n1", step, [own(1, "n1")], round_=1))
        assert answer.stale and events == []
    assert set(table.records) == {10, 15}


def test_the_rounds_own_late_reports_still_count() -> None:
    table = CheckpointTable()
    table.report(report("n0", 10, [own(0, "n0")], round_=1))
    save(table, 20, round_=2)
    answer, _ = table.report(report("n1", 10, [own(1, "n1")], round_=1))
    assert not answer.stale
    assert table.records[10].committed


def test_a_reports_world_size_must_match_its_rounds_record() -> None:
    table = CheckpointTable()
    table.report(report("n0", 10, [own(0, "n0")], world=2))
    with pytest.raises(InvalidArgument, match="saved by 2 ranks"):
        table.report(report("n1", 10, [own(1, "n1")], world=4))


# ----------------------------------------------------------------- bounds


def test_the_table_keeps_at_most_keep_steps_records_dropping_the_oldest() -> None:
    table = CheckpointTable(CheckpointSettings(keep_steps=4))
    events = []
    for step in range(1, 8):
        events += save(table, step)
    assert sorted(table.records) == [4, 5, 6, 7]
    assert [e for e in events if isinstance(e, StepDropped)] == [
        StepDropped(1),
        StepDropped(2),
        StepDropped(3),
    ]


def test_the_bound_never_drops_the_newest_restorable_step() -> None:
    table = CheckpointTable(CheckpointSettings(keep_steps=4))
    save(table, 1)
    for step in range(2, 8):  # rank 1 never saves these: not committed
        table.report(report("n0", step, [own(0, "n0")]))
    assert sorted(table.records) == [1, 5, 6, 7]
    latest = table.latest()
    assert latest is not None and latest.step == 1


def test_the_bound_keeps_the_replicated_step_that_a_lost_node_falls_back_to() -> None:
    """Replicas trail the saves: step 1 is replicated, steps 2..6 committed
    on their own nodes only. The bound keeps step 1, so when n1 is lost, n0
    restores step 1 from its own image and its replica of rank 1."""
    table = CheckpointTable(CheckpointSettings(keep_steps=4))
    save(table, 1)
    for step in range(2, 8):
        table.report(report("n0", step, [own(0, "n0")]))
        table.report(report("n1", step, [own(1, "n1")]))
    assert table.replicated_step() == 1 and table.committed_step() == 7
    assert 1 in table.records
    table.node_gone("n1")
    latest = table.latest()
    assert latest is not None and latest.step == 1


def test_a_step_older_than_a_full_table_is_not_recorded() -> None:
    table = CheckpointTable(CheckpointSettings(keep_steps=4))
    for step in (5, 6, 7, 8):
        save(table, step)
    _, events = table.report(report("n0", 1, [own(0, "n0")]))
    assert events == []
    assert sorted(table.records) == [5, 6, 7, 8]


def test_keep_steps_must_leave_room_for_the_steps_the_bound_keeps() -> None:
    with pytest.raises(InvalidArgument, match="keep_steps must be at least 4"):
        CheckpointSettings(keep_steps=3)


# --------------------------------------------------------------- persisted


def test_the_newest_persisted_step_is_kept_and_older_ones_are_ignored() -> None:
    table = CheckpointTable()
    assert table.report_persisted(PersistedStep(10, "/ckpt/10", 1, 2))
    assert table.report_persisted(PersistedStep(20, "/ckpt/20", 1, 2))
    assert table.report_persisted(PersistedStep(15, "/ckpt/15", 1, 2)) == []
    status = table.status()
    assert (status.persisted_step, status.persisted_path) == (20, "/ckpt/20")


def test_a_persisted_step_of_an_abandoned_future_is_dropped_and_not_taken_again() -> None:
    table = CheckpointTable()
    save(table, 10, round_=1)
    table.report_persisted(PersistedStep(20, "/ckpt/20", 1, 2))
    save(table, 15, round_=2)
    assert table.status().persisted_step == NONE
    assert table.report_persisted(PersistedStep(20, "/ckpt/20", 1, 2)) == []
    assert table.report_persisted(PersistedStep(15, "/ckpt/15", 2, 2))
    assert table.status().persisted_path == "/ckpt/15"


# ------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (report("n0", -1, [own(0, "n0")]), "step must be >= 0"),
        (report("n0", 1, [own(0, "n0")], world=0), "world_size must be in"),
        (report("n0", 1, [own(2, "n0")]), "rank 2 is outside 0..1"),
        (report("n0", 1, [own(-1, "n0")]), "rank -1 is outside"),
        (report("", 1, [own(0, "n0")]), "node_id must not be empty"),
        (report("n0", 1, [own(0, "")]), "copy node_id must not be empty"),
        (report("n0", 1, [own(0, "n0")], round_=0), "round must be >= 1"),
        (report("n0", 1, [own(0, "n0", size=-1)]), "-1 bytes"),
        (report("n0", 1, [own(0, "n0"), own(0, "n0")]), "listed twice"),
        (report("n0", 1, [own(0, "n0")], dropped_below=2), "dropped_below must be in 0..1"),
        (report("n0", 3, [own(0, "n0")], earlier=[3]), "earlier steps must be distinct"),
        (report("n0", 3, [own(0, "n0")], earlier=[1, 1]), "earlier steps must be distinct"),
        (report("n0", 3, [own(0, "n0")], earlier=[-1]), "earlier steps must be distinct"),
        (report("n0", 99, [own(0, "n0")], earlier=range(65)), "at most 64"),
    ],
)
def test_bad_reports_are_refused_and_change_nothing(bad: CheckpointReport, message: str) -> None:
    table = CheckpointTable()
    save(table, 0)
    before = table.to_dict()
    with pytest.raises(InvalidArgument, match=message):
        table.report(bad)
    assert table.to_dict() == before


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (PersistedStep(-1, "/p", 1, 1), "step must be >= 0"),
        (PersistedStep(1, "", 1, 1), "path must not be empty"),
        (PersistedStep(1, "/p", 0, 1), "round must be >= 1"),
        (PersistedStep(1, "/p", 1, 0), "world_size"),
    ],
)
def test_bad_persisted_reports_are_refused(bad: PersistedStep, message: str) -> None:
    table = CheckpointTable()
    with pytest.raises(InvalidArgument, match=message):
        table.report_persisted(bad)
    assert table.status().persisted_step == NONE


def test_latest_refuses_a_negative_before_step_and_node_gone_an_empty_id() -> None:
    table = CheckpointTable()
    with pytest.raises(InvalidArgument, match="before_step"):
        table.latest(-1)
    with pytest.raises(InvalidArgument, match="node id"):
        table.node_gone("")


# --------------------------------------------------------------- durability


def test_replaying_the_events_and_installing_a_snapshot_rebuild_the_same_table() -> None:
    settings = CheckpointSettings(keep_steps=4)
    table = CheckpointTable(settings)
    events: list[CheckpointEvent] = []
    for step in (1, 2, 3, 4):
        events += save(table, step, world=3)
    events += table.report(report("n0", 4, [own(0, "n0")], world=3, dropped_below=3))[1]
    events += table.report_persisted(PersistedStep(3, "/ckpt/3", 1, 3))
    events += save(table, 3, round_=2, world=3)
    events += table.node_gone("n2")
    assert replayed(events, settings).to_dict() == table.to_dict()
    copy = CheckpointTable(settings)
    copy.install(table.to_dict())
    assert copy.to_dict() == table.to_dict()
    assert copy.latest() == table.latest()
